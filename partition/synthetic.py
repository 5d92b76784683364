"""Analytic device profiles for tests and benchmarks (no measurement, no torch).

The latency model is the one the profiler's interpolation assumes:
``a + b·x + c·x·(y + x/2)`` per decoder layer for a chunk of ``x`` tokens after
``y`` cached ones, plus an embedding and a head that are linear in ``x``. The
default constants are rough figures for the embedded model (SmolLM2-135M,
float32) on one thread of this machine, so synthetic plans look like real ones.
"""

from __future__ import annotations

import numpy as np

from partition.interpolate import min_efficient_chunk
from partition.profile import DEFAULT_HEADROOM, DeviceProfile, ModelInfo, QGrid, memory_budget

SMOLLM2_135M = ModelInfo(
    identity="synthetic:SmolLM2-135M",
    arch="llama",
    num_layers=30,
    hidden_size=576,
    intermediate_size=1536,
    vocab_size=49152,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    tie_embeddings=True,
)

Q_X = (1, 16, 32, 64, 128, 256, 512, 1024, 2048)
Q_Y = (0, 256, 512, 1024, 1536, 2048)
CALIB = (1, 16, 64, 256, 1024, 2048)
DECODE_CTX = (0, 256, 512, 1024, 2048)


def small_model(num_layers: int, identity: str | None = None) -> ModelInfo:
    """The embedded model's shapes with fewer layers (for brute-force-sized tests)."""
    from dataclasses import replace

    return replace(SMOLLM2_135M, num_layers=num_layers,
                    identity=identity or f"synthetic:{num_layers}-layer")


def layer_weight_bytes(model: ModelInfo, dtype_bytes: int = 4) -> int:
    h, f, kv = model.hidden_size, model.intermediate_size, model.num_kv_heads * model.head_dim
    q = model.num_heads * model.head_dim
    params = h * q + 2 * h * kv + q * h + 3 * h * f + 2 * h
    return params * dtype_bytes


def synthetic_profile(
    device_id: str = "synthetic",
    *,
    speed: float = 1.0,
    memory_bytes: int = 8 * 2**30,
    headroom: float = DEFAULT_HEADROOM,
    model: ModelInfo = SMOLLM2_135M,
    overhead_s: float = 2e-4,
    per_token_s: float = 2.0e-4,
    per_token_ctx_s: float = 4e-8,
    head_s: float = 1.2e-2,
    embed_per_token_s: float = 2e-6,
    layer_jitter: np.ndarray | None = None,
) -> DeviceProfile:
    """A profile following the analytic model, ``speed`` times as fast as the default."""
    L = model.num_layers
    jitter = np.ones(L) if layer_jitter is None else np.asarray(layer_jitter, dtype=float)

    def layer(x, y):
        x = np.asarray(x, dtype=float)
        return (overhead_s + per_token_s * x + per_token_ctx_s * x * (y + x / 2.0)) / speed

    def head(x):
        # prefill computes logits for the last position only: constant in x
        return (overhead_s + head_s + 0.0 * np.asarray(x, dtype=float)) / speed

    def embed(x):
        return (1e-5 + embed_per_token_s * np.asarray(x, dtype=float)) / speed

    rows = [tuple(float(embed(s)) for s in CALIB)]
    rows += [tuple(float(layer(s, 0) * jitter[i]) for s in CALIB) for i in range(L)]
    rows += [tuple(float(head(s)) for s in CALIB)]
    qgrid = tuple(tuple(float(layer(x, y)) for y in Q_Y) for x in Q_X)
    decode = tuple(float(L * layer(1, c) + head(1) + embed(1)) for c in DECODE_CTX)
    per_chunk = [L * layer(x, 0) + head(x) + embed(x) for x in Q_X]
    dtype_bytes = 4
    wl = layer_weight_bytes(model, dtype_bytes)
    emb = model.vocab_size * model.hidden_size * dtype_bytes
    return DeviceProfile(
        device_id=device_id,
        model=model,
        dtype="float32",
        threads=1,
        torch_version="synthetic",
        measured_at="1970-01-01T00:00:00+00:00",
        calib_seq_lens=CALIB,
        layer_latency_s=tuple(rows),
        q=QGrid(Q_X, Q_Y, qgrid),
        decode_context=DECODE_CTX,
        decode_step_s=decode,
        min_chunk=min_efficient_chunk(Q_X, per_chunk),
        weight_bytes=(emb,) + (wl,) * L + (emb + model.hidden_size * dtype_bytes,),
        kv_bytes_per_token_per_layer=2 * model.num_kv_heads * model.head_dim * dtype_bytes,
        memory_total_bytes=int(memory_bytes),
        memory_headroom=headroom,
        memory_budget_bytes=memory_budget(int(memory_bytes), headroom),
        settings={"synthetic": True},
        host={"kind": "synthetic"},
    )
