"""The stop set of a GGUF model: its eos, and the end-of-turn/-message tokens a chat model ends with.

Llama 3.1 ends a tool call with <|eom_id|> and a turn with <|eot_id|>; a GGUF records one eos. Without
both in the stop set a free-text answer would run on past the end of a tool call."""

from decoding.loader.gguf_source import end_of_generation

LLAMA3_VOCAB = {"<|begin_of_text|>": 128000, "<|end_of_text|>": 128001, "<|eom_id|>": 128008, "<|eot_id|>": 128009}


def _fields(values: dict):
    return lambda key, default=None: values.get(key, default)


def test_llama3_stops_at_end_of_turn_and_end_of_message_whatever_the_file_calls_eos():
    assert end_of_generation((128009,), _fields({}), LLAMA3_VOCAB) == (128009, 128008)
    assert end_of_generation((128001,), _fields({}), LLAMA3_VOCAB) == (128001, 128009, 128008)


def test_recorded_end_of_turn_ids_join_the_eos_once():
    fields = _fields({"tokenizer.ggml.eot_token_id": 7, "tokenizer.ggml.eom_token_id": 2})
    assert end_of_generation((2,), fields, {"<|im_end|>": 2}) == (2, 7)


def test_a_vocabulary_without_those_tokens_keeps_its_eos_alone():
    assert end_of_generation((151645,), _fields({}), {"<|im_end|>": 151645, "<|endoftext|>": 151643}) == (151645,)
    assert end_of_generation((), _fields({}), {}) == ()
