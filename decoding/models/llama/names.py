"""How each file format names the Llama family's tensors, and the canonical names stages ask for.

Canonical tensor names (HF orientation, weight = [out_features, in_features]):
``embed``, ``final_norm``, ``lm_head``, ``rope_freqs`` and, per layer i,
``layers.{i}.`` + ``attn_norm q k v o q_bias k_bias v_bias mlp_norm gate up down``.

llama.cpp stores Llama/Mistral q and k projections with rows permuted for its
interleaved RoPE; :func:`unpermute_rows` undoes that so the same rotate-half
RoPE as Hugging Face applies. Qwen2 GGUFs are not permuted
(``config.GGUF_PERMUTED``).
"""

from __future__ import annotations

import numpy as np

from decoding.config import ModelConfig
from decoding.models.llama.config import GGUF_PERMUTED

_GGUF_LAYER = {
    "attn_norm": "attn_norm", "attn_q": "q", "attn_k": "k", "attn_v": "v",
    "attn_output": "o", "ffn_norm": "mlp_norm", "ffn_gate": "gate", "ffn_up": "up",
    "ffn_down": "down",
}
_GGUF_GLOBAL = {"token_embd.weight": "embed", "output_norm.weight": "final_norm",
                "output.weight": "lm_head"}

_HF_LAYER = {
    "input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "q",
    "self_attn.k_proj.weight": "k", "self_attn.v_proj.weight": "v",
    "self_attn.o_proj.weight": "o", "post_attention_layernorm.weight": "mlp_norm",
    "mlp.gate_proj.weight": "gate", "mlp.up_proj.weight": "up", "mlp.down_proj.weight": "down",
    "self_attn.q_proj.bias": "q_bias", "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
}
_HF_GLOBAL = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm",
              "lm_head.weight": "lm_head"}


def gguf_canonical(name: str) -> str | None:
    """The canonical name of a GGUF tensor (``blk.3.attn_q.weight`` -> ``layers.3.q``), None if unused."""
    if name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[name]
    if name == "rope_freqs.weight":
        return "rope_freqs"
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk":
        base = _GGUF_LAYER.get(parts[2])
        if base is None:
            return None
        if parts[3] == "bias":
            return f"layers.{parts[1]}.{base}_bias"
        return f"layers.{parts[1]}.{base}"
    return None


def hf_canonical(key: str) -> str | None:
    """The canonical name of a safetensors key (``model.layers.3.self_attn.q_proj.weight`` -> ``layers.3.q``)."""
    if key in _HF_GLOBAL:
        return _HF_GLOBAL[key]
    parts = key.split(".", 3)
    if len(parts) == 4 and parts[0] == "model" and parts[1] == "layers":
        base = _HF_LAYER.get(parts[3])
        return f"layers.{parts[2]}.{base}" if base else None
    return None


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's convert-time permute(w, n_head)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_heads_permuted(config: ModelConfig, name: str) -> int | None:
    """How many heads a GGUF tensor's rows were permuted over (None: not permuted).

    Only q and k (and their biases) of the architectures llama.cpp permutes.
    """
    if config.arch not in GGUF_PERMUTED:
        return None
    if name.endswith(".q") or name.endswith(".q_bias"):
        return config.num_heads
    if name.endswith(".k") or name.endswith(".k_bias"):
        return config.num_kv_heads
    return None
