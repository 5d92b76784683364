"""Tiny random-weight checkpoints for fast exactness tests (the session fixtures built on them are in
tests/conftest.py)."""

from __future__ import annotations

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
