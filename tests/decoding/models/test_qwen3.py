"""Qwen3 (decoding/models/qwen3): meshd computes transformers' logits, from a Hugging Face directory and
from GGUF, on one device and across a 2-stage mesh, in every numeric mode.

The tiny models are Qwen3's shape where it matters to the math: head_dim 32 on
a 64-wide model with 4 heads (so q is wider than the hidden state, as in
Qwen3-4B), grouped keys, no q/k/v biases, per-head norms far from 1; tied (the
0.6B-4B models) and untied (8B).
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from decoding.errors import ModelLoadError
from decoding.loader import open_model
from decoding.models import qwen3
from tests.support.parity import MODES, SOURCES, TOLERANCE, TinyFiles, assert_equals_transformers, token_ids

KINDS = ("qwen3", "qwen3-tied")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return {kind: TinyFiles.write(kind, tmp_path_factory.mktemp(kind)) for kind in KINDS}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("kind", KINDS)
def test_logits_equal_transformers_on_one_device_and_two_stages(tiny, kind, source, mode):
    assert_equals_transformers(tiny[kind], source, mode)


@pytest.mark.parametrize("source", ["hf", "F16"])
def test_the_config_says_qwen3_with_its_head_dim_no_biases_and_the_tie(tiny, source):
    for kind, tied in (("qwen3", False), ("qwen3-tied", True)):
        src = open_model(tiny[kind].paths[source])
        cfg = src.config
        assert (cfg.arch, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads) == ("qwen3", 32, 4, 2)
        assert cfg.hidden_size == 64 and cfg.rope_theta == 1_000_000.0
        assert cfg.rms_eps == pytest.approx(1e-6)  # a GGUF holds it in float32
        assert not cfg.attention_bias and cfg.rope_scaling is None and cfg.sliding_window is None
        assert cfg.tie_embeddings is tied and src.has_tensor("lm_head") is not tied
        assert (cfg.bos_id, cfg.eos_ids) == (1, (2,))


def test_each_layer_holds_its_query_and_key_head_norms(tiny):
    src = open_model(tiny["qwen3"].paths["Q4_0"])
    stage = src.load_stage(1, 3, torch.bfloat16, packed="packed")
    assert type(stage) is qwen3.StageModel
    attn = tiny["qwen3"].model.model.layers[2].self_attn
    lw = stage.layers[1]
    assert isinstance(lw, qwen3.Qwen3LayerWeights)
    assert lw.q_norm.dtype == torch.bfloat16 and lw.q_norm.shape == (32,)
    assert torch.equal(lw.q_norm, attn.q_norm.weight.detach().bfloat16())
    assert torch.equal(lw.k_norm, attn.k_norm.weight.detach().bfloat16())


def test_the_head_norms_matter_to_these_logits(tiny):
    """Guard on the model, not on meshd: were its query head norms ones, the logits would move beyond
    every mode's tolerance, so the equalities above would see a norm skipped or swapped."""
    model = tiny["qwen3"].model
    ids = torch.tensor([token_ids(model.config.vocab_size)])
    with torch.no_grad():
        want = model(ids).logits
        saved = [(a.q_norm.weight.clone(), a.k_norm.weight.clone()) for a in (l.self_attn for l in model.model.layers)]
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.fill_(1.0)
        try:
            plain = model(ids).logits
        finally:
            for layer, (q, k) in zip(model.model.layers, saved):
                layer.self_attn.q_norm.weight.copy_(q)
                layer.self_attn.k_norm.weight.copy_(k)
    assert (plain - want).abs().max().item() > max(TOLERANCE.values())


def test_gguf_tensor_names_map_to_the_head_norms():
    assert qwen3.gguf_canonical("blk.7.attn_q_norm.weight") == "layers.7.q_norm"
    assert qwen3.gguf_canonical("blk.7.attn_k_norm.weight") == "layers.7.k_norm"
    assert qwen3.gguf_canonical("blk.7.attn_q.weight") == "layers.7.q"
    assert qwen3.hf_canonical("model.layers.7.self_attn.k_norm.weight") == "layers.7.k_norm"
    assert qwen3.hf_canonical("model.embed_tokens.weight") == "embed"
    assert qwen3.gguf_canonical("blk.7.attn_q_norm.bias") is None


def test_a_qwen3_file_without_head_norms_is_refused_naming_the_tensor(tiny, tmp_path):
    d = tmp_path / "no-norms"
    d.mkdir()
    hf = tiny["qwen3"].paths["hf"]
    (d / "config.json").write_text((hf / "config.json").read_text())
    weights = {k: v for k, v in load_file(str(next(hf.glob("*.safetensors")))).items() if "k_norm" not in k}
    save_file(weights, str(d / "model.safetensors"))
    assert json.loads((d / "config.json").read_text())["model_type"] == "qwen3"
    with pytest.raises(ModelLoadError, match=r"no-norms: tensor 'layers.0.k_norm' missing"):
        open_model(d).load_stage(0, 1)
