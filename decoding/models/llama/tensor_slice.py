"""A tensor-parallel member's share of a Llama-family stage: the same block over its heads and MLP columns.

Why the member is an ordinary :class:`StageModel` over smaller matrices: the whole forward (prompt chunks,
decode steps through the two-call kernel, verify rounds, forks of a cached prefix) then runs unchanged on
a member, with only two points that differ from one device — the attention output and the MLP output are
partial sums that the group adds up (``stage.group``), and the LM head returns the member's vocabulary
rows, gathered into the full row. Megatron's split: q/k/v and gate/up by output rows, o and down by input
columns, so each layer costs two reductions and each member reads ~1/n of every matrix (or, with the
attention held whole by every member, one reduction and ~1/n of the MLP).

A member's copy is its own memory (the slices are copied out of the mapped file), so a member holds its
share, not the file.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from decoding.models.llama.layers import LayerWeights
from partition.tensor_split import LayerShape, MemberSlice


class UnsplittableStage(ValueError):
    """A stage whose weights a member cannot take a share of (a packed mode, a model family's extra tensors)."""


def layer_shape(stage) -> LayerShape:
    """The widths and block sizes a split of ``stage`` must respect."""
    cfg = stage.config
    o_block = max((_input_block(lw.o) for lw in stage.layers), default=1)
    down_block = max((_input_block(lw.down) for lw in stage.layers), default=1)
    return LayerShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size,
                      o_block, down_block)


def member_stage(stage, member: MemberSlice, group):
    """The stage ``member`` of a group runs: its rows and columns of ``stage``'s layers, its vocabulary rows
    of the head, ``group`` (``decoding.tensor_group.PartialSums``) adding up its partial sums."""
    cfg = stage.config
    if stage.dtype != torch.float32:
        raise UnsplittableStage(f"a group adds float32 partial sums; this stage computes in {stage.dtype}")
    hd = cfg.head_dim
    h0, h1 = member.heads
    k0, k1 = member.kv_heads
    i0, i1 = member.inter
    q_rows = np.arange(h0 * hd, h1 * hd)
    kv_rows = np.arange(k0 * hd, k1 * hd)
    qkv_rows = np.concatenate([q_rows, cfg.num_heads * hd + kv_rows, (cfg.num_heads + cfg.num_kv_heads) * hd + kv_rows])
    inter = cfg.intermediate_size
    gate_up_rows = np.concatenate([np.arange(i0, i1), inter + np.arange(i0, i1)])
    layers = []
    for lw in stage.layers:
        known = {f.name for f in dataclasses.fields(LayerWeights)} | set(getattr(type(lw), "shared_by_heads", ()))
        if set(vars(lw)) - known:
            raise UnsplittableStage(f"{type(lw).__name__} holds tensors a member's split does not know")
        layers.append(dataclasses.replace(
            lw, qkv=_rows(lw.qkv, qkv_rows), qkv_bias=None if lw.qkv_bias is None else lw.qkv_bias[qkv_rows].clone(),
            o=_columns(lw.o, h0 * hd, h1 * hd), gate_up=_rows(lw.gate_up, gate_up_rows), down=_columns(lw.down, i0, i1)))
    local = dataclasses.replace(cfg, num_heads=h1 - h0, num_kv_heads=k1 - k0, intermediate_size=i1 - i0)
    lm_head = None if stage.lm_head is None else _rows(stage.lm_head, np.arange(*member.vocab))
    out = type(stage)(local, stage.first, stage.end, layers, stage.embed, stage.final_norm, lm_head, stage.inv_freq,
                      stage.dtype)
    out.formats, out.scratch, out.packing = dict(stage.formats), stage.scratch, stage.packing
    out.vocab_start = member.vocab[0]
    # a member holding every head (attention "whole") has its attention output whole: only the MLP is summed
    out.join_group(group, attention_split=(h1 - h0) < cfg.num_heads)
    return out


def _input_block(w) -> int:
    if isinstance(w, torch.Tensor):
        return 1
    parts = getattr(w, "parts", None)
    if parts is None:
        raise UnsplittableStage(f"a {type(w).__name__} matrix cannot be split between members")
    from decoding.quant import native

    return max(native.library().meshd_block_elems(native.TYPE_IDS[p.type_name]) for p in parts)


def _rows(w, ids: np.ndarray):
    if isinstance(w, torch.Tensor):
        return w[torch.from_numpy(ids)].contiguous()
    if hasattr(w, "parts"):
        return w.only(ids)
    raise UnsplittableStage(f"a {type(w).__name__} matrix cannot be split between members")


def _columns(w, start: int, stop: int):
    if isinstance(w, torch.Tensor):
        return w[:, start:stop].contiguous()
    if hasattr(w, "parts"):
        return w.columns(start, stop)
    raise UnsplittableStage(f"a {type(w).__name__} matrix cannot be split between members")
