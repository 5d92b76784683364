"""Tiny random Qwen3 and Llama 3.x models, built with transformers, for checking meshd's model math.

Each kind is shaped like its real models where that matters to the math:
Qwen3's head_dim is not hidden/heads (Qwen3-4B: 2560 wide, 32 heads of 128),
its small sizes tie the head to the embedding and 8B does not; Llama 3.2
1B/3B tie, 3.1 8B does not, and both scale RoPE by ``llama3`` — here with 3.2's
factors but an original context of 32 positions, so that the scaling bends the
frequencies a 76-token prompt turns through (with Meta's 8192 it would hardly
move them).
Every weight is perturbed (norms included), so a norm applied to the wrong
thing, or not at all, shows in the logits.
"""

from __future__ import annotations

from pathlib import Path

import torch

#: RoPE scaling of the tiny Llama 3 models (Llama 3.2's factors, a short original context).
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}

_COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
               bos_token_id=1, eos_token_id=2)

#: kind -> (architecture, config overrides).
KINDS: dict[str, tuple[str, dict]] = {
    "qwen3": ("qwen3", dict(head_dim=32, tie_word_embeddings=False, rope_theta=1_000_000.0)),
    "qwen3-tied": ("qwen3", dict(head_dim=32, tie_word_embeddings=True, rope_theta=1_000_000.0)),
    "llama3": ("llama", dict(tie_word_embeddings=False, rope_theta=10_000.0, rope_scaling=dict(LLAMA3_ROPE))),
    "llama3-tied": ("llama", dict(tie_word_embeddings=True, rope_theta=10_000.0, rope_scaling=dict(LLAMA3_ROPE))),
}


def build_model(kind: str, seed: int = 0, **overrides):
    """A random-weight transformers causal LM of ``kind`` (a key of :data:`KINDS`), in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    arch, extra = KINDS[kind]
    params = {**_COMMON, **extra, **overrides}
    theta = params.pop("rope_theta")
    scaling = params.pop("rope_scaling", None)
    params["rope_parameters"] = {"rope_theta": theta, **(scaling or {"rope_type": "default"})}
    torch.manual_seed(seed)
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**params))
    else:
        model = LlamaForCausalLM(LlamaConfig(**params))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norms: far from 1 and from each other
                p.copy_(0.5 + torch.rand_like(p))
            else:
                p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def save_hf_dir(model, path: Path) -> Path:
    """``model`` saved as a Hugging Face directory (config.json + safetensors)."""
    model.save_pretrained(path, safe_serialization=True)
    return Path(path)
