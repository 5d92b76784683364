"""Our plain-torch forward computes the same logits as transformers on the same weights."""

import pytest
import torch

from decoding.loader import open_model

TOL = 1e-3  # float32; observed differences are ~1e-6 (tiny) and ~1e-4 (SmolLM2, 30 layers)


def _ours(source, ids):
    stage = source.load_stage(0, source.config.num_layers)
    kv = stage.new_cache()
    kv.create("s", len(ids))
    return stage.forward(kv, "s", torch.tensor(ids))


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_tiny_random_model_logits_match_transformers(fixture, request):
    path, model = request.getfixturevalue(fixture)
    ids = torch.randint(0, model.config.vocab_size, (23,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    ours = _ours(open_model(path), ids)
    assert (ours - ref).abs().max().item() < TOL


def test_qwen2_variant_uses_attention_biases(tiny_qwen2):
    path, _ = tiny_qwen2
    src = open_model(path)
    assert src.config.attention_bias and src.config.tie_embeddings
    assert src.load_stage(0, 1).layers[0].qkv_bias is not None


@pytest.mark.slow
def test_embedded_gguf_logits_match_transformers_gguf_loader(real_source):
    """transformers dequantises the same GGUF (and undoes llama.cpp's q/k permutation) independently."""
    from transformers import AutoModelForCausalLM

    src = real_source
    ids = src.tokenizer.apply_chat([{"role": "user", "content": "Turn off the kitchen lights at 11pm."}])
    model = AutoModelForCausalLM.from_pretrained(str(src.path.parent), gguf_file=src.path.name,
                                                 dtype=torch.float32)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    del model
    assert (_ours(src, ids) - ref).abs().max().item() < TOL


@pytest.mark.slow
def test_embedded_tokenizer_matches_transformers_chat_template(real_source):
    from transformers import AutoTokenizer

    msgs = [{"role": "user", "content": "Is the garage door closed? Ünïcode ✓"}]
    hf = AutoTokenizer.from_pretrained(str(real_source.path.parent), gguf_file=real_source.path.name)
    expected = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert real_source.tokenizer.apply_chat(msgs) == list(expected)
