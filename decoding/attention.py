"""Attention over a sequence's cached keys, in the shapes a stage needs besides one plain SDPA call.

Grouped-query attention over the KV cache is the same for every decoder
architecture here; what differs per architecture (projections, RoPE, norms)
lives in ``decoding.models``. q is [heads, n, head_dim]; keys and values are
[kv_heads, length, head_dim], possibly in several segments (a forked
sequence's shared prefixes, then its own positions).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from decoding.batch import EXACT_BLOCK, RowPlan
from decoding.masks import chunk_mask
from decoding.quant import row_ops


def upto(segments: list[tuple[torch.Tensor, torch.Tensor]], end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``end`` positions of keys/values stored in ``segments`` (views)."""
    out, left = [], end
    for k, v in segments:
        if left <= 0:
            break
        take = min(left, k.shape[1])
        out.append((k[:, :take], v[:, :take]))
        left -= take
    return out


def exact_attention(p: RowPlan, q: torch.Tensor, segments: list[tuple[torch.Tensor, torch.Tensor]], scale: float,
                    gqa: bool) -> torch.Tensor:
    """Attention that gives each row the same bits however its sequence was cut or batched.

    A whole position block attends in one call over exactly the keys up to its
    end; any other row attends alone over the keys up to itself, as a decode
    step does. CPU SDPA's result for a row does depend on the other rows of the
    call (its tiles), so these are the only two shapes of call a row ever sees.
    In the gguf mode (float32) a lone row attends through the kernels' own
    one-row attention (``decoding.quant.row_ops.row_attention``: SDPA's splits a
    lone row's keys between threads), which reads a forked sequence's segments in
    place; the others are joined once, only if a block or a tree node needs them.
    """
    joined: list = []

    def whole() -> tuple[torch.Tensor, torch.Tensor]:
        if not joined:
            joined.append(segments[0] if len(segments) == 1 else
                          (torch.cat([k for k, _ in segments], dim=1), torch.cat([v for _, v in segments], dim=1)))
        return joined[0]

    outs, i = [], 0
    lone_rows = q.dtype == torch.float32  # the gguf mode
    whole_rows = p.whole.tolist()
    while i < p.n:
        if p.mask is not None:  # a tree node: its ancestors and itself
            sel = p.mask[i].nonzero().squeeze(1)
            keys, values = whole()
            kv_i, rows, mask = [(keys[:, sel], values[:, sel])], 1, None
        elif whole_rows[i]:
            rows, end = EXACT_BLOCK, p.past + i + EXACT_BLOCK
            kv_i = [tuple(t[:, :end] for t in whole())]
            mask = torch.arange(end, device=q.device).unsqueeze(0) <= p.positions[i:i + rows].unsqueeze(1)
        else:
            rows, end, mask = 1, p.past + i + 1, None
            kv_i = upto(segments, end) if lone_rows else [tuple(t[:, :end] for t in whole())]
        if rows == 1 and lone_rows:
            outs.append(row_ops.row_attention(q[:, i:i + 1], kv_i, scale))
        else:
            (k_i, v_i), = kv_i
            outs.append(F.scaled_dot_product_attention(
                q[:, i:i + rows].contiguous().unsqueeze(0), k_i.unsqueeze(0), v_i.unsqueeze(0), attn_mask=mask,
                scale=scale, enable_gqa=gqa)[0])
        i += rows
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def attention_tail(q: torch.Tensor, segments, p: RowPlan, width: int, scale: float) -> torch.Tensor:
    """[n, width]: head-averaged attention of the new rows on the last ``width`` positions."""
    nh, n, hd = q.shape
    nkv = segments[0][0].shape[0]
    qg = q.reshape(nkv, (nh // nkv) * n, hd)
    scores = torch.cat([torch.matmul(qg, k.transpose(-1, -2)) for k, _ in segments], dim=-1)
    scores = scores.view(nkv, nh // nkv, n, -1).float() * scale
    mask = p.mask if p.mask is not None else chunk_mask(0, n, q.device) if p.causal else None
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).mean(dim=(0, 1))  # [n, positions]
    tail = probs[:, -width:]
    if tail.shape[1] < width:  # fewer positions than asked: pad on the left
        tail = F.pad(tail, (width - tail.shape[1], 0))
    return tail


def segmented_attention(q: torch.Tensor, segments: list[tuple[torch.Tensor, torch.Tensor]],
                        mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Attention over keys/values stored in several places (a forked child's shared prefixes, then its own).

    Concatenating the segments would copy every ancestor's prefix at every
    layer and step; the scores are what get concatenated instead (per head,
    n x positions — for one decode step a few hundred floats against the
    prefix's thousands). ``mask`` [n, positions] (True = may attend) spans all
    segments in order; None means every new row sees every position.
    q: [heads, n, head_dim]; segment keys/values: [kv_heads, length, head_dim].
    """
    nh, n, hd = q.shape
    nkv = segments[0][0].shape[0]
    g = nh // nkv
    qg = q.reshape(nkv, g * n, hd)  # query heads grouped under the kv head they share
    scores = torch.cat([torch.matmul(qg, k.transpose(-1, -2)) for k, _ in segments], dim=-1)
    scores = scores.view(nkv, g, n, -1) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype).view(nkv, g * n, -1)
    out, start = None, 0
    for k, v in segments:
        part = torch.matmul(probs[..., start:start + k.shape[1]], v)
        out = part if out is None else out + part
        start += k.shape[1]
    return out.view(nh, n, hd)
