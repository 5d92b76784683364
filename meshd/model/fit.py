"""Does the model fit this device? What to say when it does not.

A home pools memory: each member holds only its layer range, so a model too
big for any one device still runs on several. A device that cannot hold the
model alone must say so at once, with what to do, instead of sitting unplanned.
"""

from __future__ import annotations


#: Bytes per weight of the packed numeric modes: a 4-bit code plus a bfloat16 scale and offset per
#: 32 (``packed`` holds a file's wider tensors at twice that; a home's GGUFs are mostly 4-bit).
PACKED_BYTES_PER_WEIGHT = 0.5 + 4 / 32


def weight_bytes(config, dtype_bytes: float) -> int:
    """Resident weights of the whole model at ``dtype_bytes`` per parameter (Llama family)."""
    h, kv = config.hidden_size, config.num_kv_heads * config.head_dim
    q = config.num_heads * config.head_dim
    layer = h * (q + 2 * kv) + q * h + 3 * h * config.intermediate_size + 2 * h
    if getattr(config, "attention_bias", False):
        layer += q + 2 * kv
    embed = config.vocab_size * h * (1 if config.tie_embeddings else 2)
    return int((config.num_layers * layer + embed + h) * dtype_bytes)


def fit_advice(config, dtype_bytes: float, budget_mb: int, model: str, dtype: str) -> str | None:
    """None when the whole model fits ``budget_mb``; otherwise what the user can do."""
    need_mb = weight_bytes(config, dtype_bytes) / 2**20
    if need_mb <= budget_mb:
        return None
    hint = " or --weights packed (4-bit matrices, about a sixth of float32)" if dtype_bytes >= 2 else ""
    return (f"{model} needs about {need_mb:,.0f} MiB of weights in {dtype}, more than the {budget_mb:,} MiB this "
            f"device lends (--memory-budget-mb): add another device to the home with 'meshd invite' (the mesh "
            f"pools memory: each member holds only its layers), raise --memory-budget-mb{hint}, or serve a "
            f"smaller model")
