"""Model fixtures: tiny random-weight checkpoints for fast exactness tests, and the real embedded model."""

from __future__ import annotations

import pytest
import torch


def build_tiny_checkpoint(path, arch: str = "llama", seed: int = 0, **overrides):
    """Save a small random-weight transformers model (safetensors + config.json) to ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=211, hidden_size=64, intermediate_size=144, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, tie_word_embeddings=False)
    common.update(overrides)
    torch.manual_seed(seed)
    if arch == "qwen2":
        cfg = Qwen2Config(**common)
        model = Qwen2ForCausalLM(cfg)
    else:
        cfg = LlamaConfig(**common)
        model = LlamaForCausalLM(cfg)
    # Random init leaves norms at 1 and small weights; perturb everything so bugs show up.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    model = build_tiny_checkpoint(path, "llama")
    return path, model


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen2")
    model = build_tiny_checkpoint(path, "qwen2", seed=1, tie_word_embeddings=True)
    return path, model


@pytest.fixture(scope="session")
def real_source():
    """The embedded SmolLM2-135M-Instruct (pulled by the set-up script)."""
    from meshd import model_store

    if not model_store.is_pulled():
        model_store.pull(quiet=True)
    return model_store.open_model(None)


@pytest.fixture(scope="session")
def real_stage(real_source):
    """The whole embedded model as one stage (loaded once per test session)."""
    return real_source.load_stage(0, real_source.config.num_layers)


@pytest.fixture(scope="session")
def served_stage(real_source):
    """The whole embedded model as one stage in the numeric mode a daemon serves in by default
    (``--weights auto``: packed on a CPU with torch's int4 kernel): the reference a mesh must equal."""
    from decoding.device import Placement

    p = Placement.resolve("cpu")
    stage = real_source.load_stage(0, real_source.config.num_layers, p.dtype, packed=p.packed)
    # Like a daemon (which answers a warm-up request before it serves): a process's very first
    # packed forward has been seen to differ from all later ones in the last bits, with two torch
    # threads (bench/RESULTS.md, issue #30's notes); every later forward is the same.
    kv = stage.new_cache(64)
    kv.create("warm-up", 8)
    stage.forward(kv, "warm-up", torch.tensor([1, 2, 3]))
    return stage
