"""The embedded model really generates: sensible English, deterministic."""

import pytest

from decoding.generate import generate
from decoding.pipeline_local import LocalPipeline

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pipe(real_source, real_stage):
    return LocalPipeline([real_stage])


def test_greedy_answer_is_sensible_and_identical_across_runs(real_source, pipe):
    tok = real_source.tokenizer
    ids = tok.apply_chat([{"role": "user", "content": "What is the capital of France?"}])
    first = generate(pipe, ids, 24, eos_ids=tok.eos_ids, tokenizer=tok)
    second = generate(pipe, ids, 24, eos_ids=tok.eos_ids, tokenizer=tok)
    assert "Paris" in first.text
    assert first.token_ids == second.token_ids
    assert first.finish_reason == "stop"


def test_streamed_text_equals_final_text(real_source, pipe):
    tok = real_source.tokenizer
    ids = tok.apply_chat([{"role": "user", "content": "Name two common kitchen appliances."}])
    pieces = []
    res = generate(pipe, ids, 32, eos_ids=tok.eos_ids, tokenizer=tok, on_text=pieces.append)
    assert "".join(pieces) == res.text
    assert any(w in res.text.lower() for w in ("refrigerator", "oven", "microwave", "toaster",
                                               "stove", "dishwasher", "blender", "fridge"))
