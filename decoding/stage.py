"""One pipeline stage: a contiguous range [first, end) of a Llama-family decoder.

A plain-torch forward (RMSNorm, RoPE, grouped-query attention through
scaled_dot_product_attention, SwiGLU MLP) so that the same code runs the whole
model on one device or any slice of it on many. The first stage embeds token
ids; the last applies the final norm and the LM head; every stage appends the
new positions to its own KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from decoding.config import ModelConfig
from decoding.errors import ContextOverflow, ModelLoadError
from decoding.kv_cache import KVCache
from decoding.loader.rope import inv_frequencies
from decoding.masks import chunk_mask, tree_depths, with_prefix


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    qkv: torch.Tensor  # fused [q; k; v] rows: one matmul instead of three
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    mlp_norm: torch.Tensor
    gate_up: torch.Tensor  # fused [gate; up]
    down: torch.Tensor

    def nbytes(self) -> int:
        ts = [self.attn_norm, self.qkv, self.o, self.mlp_norm, self.gate_up, self.down]
        if self.qkv_bias is not None:
            ts.append(self.qkv_bias)
        return sum(t.numel() * t.element_size() for t in ts)


# CPU GEMMs with 2 or 3 rows take a path that re-reads the weights once per row
# (measured, torch 2.13 CPU, one thread: the 49152x576 LM head costs 10 / 24 / 35 /
# 17 ms for 1 / 2 / 3 / 4 rows). Verify rounds of 2-3 tokens hit exactly those
# shapes; padding them to 4 rows makes them cost what 4 rows cost.
_PAD_ROWS = (2, 3)
_PADDED = 4


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, with 2-3 rows on CPU computed as 4 (zero rows, sliced off)."""
    n = x.shape[0]
    if n in _PAD_ROWS and x.dim() == 2 and x.device.type == "cpu":
        padded = torch.cat([x, x.new_zeros(_PADDED - n, x.shape[1])])
        return F.linear(padded, w, b)[:n]
    return F.linear(x, w, b)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on [heads, n, head_dim] with cos/sin [n, head_dim]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class StageModel:
    def __init__(self, config: ModelConfig, first: int, end: int, layers: list[LayerWeights],
                 embed: torch.Tensor | None, final_norm: torch.Tensor | None,
                 lm_head: torch.Tensor | None, inv_freq: torch.Tensor, dtype: torch.dtype):
        self.config = config
        self.first, self.end = first, end  # decoder layers [first, end)
        self.layers = layers
        self.embed, self.final_norm, self.lm_head = embed, final_norm, lm_head
        self.inv_freq = inv_freq
        self.dtype = dtype
        self.scale = config.head_dim ** -0.5

    # -- construction -------------------------------------------------------------
    @classmethod
    def from_source(cls, source, first: int, end: int, dtype: torch.dtype = torch.float32) -> "StageModel":
        cfg = source.config
        if not 0 <= first < end <= cfg.num_layers:
            raise ModelLoadError(
                f"{source.path}: invalid layer range [{first}, {end}) for a {cfg.num_layers}-layer model")
        cast = lambda t: t.to(dtype).contiguous()  # noqa: E731
        layers = []
        for i in range(first, end):
            r = lambda n: source.read_tensor(f"layers.{i}.{n}")  # noqa: E731
            bias = None
            if cfg.attention_bias:
                bias = cast(torch.cat([r("q_bias"), r("k_bias"), r("v_bias")]))
            layers.append(LayerWeights(
                attn_norm=cast(r("attn_norm")), qkv=cast(torch.cat([r("q"), r("k"), r("v")])),
                qkv_bias=bias, o=cast(r("o")), mlp_norm=cast(r("mlp_norm")),
                gate_up=cast(torch.cat([r("gate"), r("up")])), down=cast(r("down")),
            ))
        embed = final_norm = lm_head = None
        is_last = end == cfg.num_layers
        if first == 0 or (is_last and cfg.tie_embeddings):
            embed_full = cast(source.read_tensor("embed"))
            embed = embed_full if first == 0 else None
            if is_last and cfg.tie_embeddings:
                lm_head = embed_full
        if is_last:
            final_norm = cast(source.read_tensor("final_norm"))
            if lm_head is None:
                lm_head = cast(source.read_tensor("lm_head"))
        inv_freq, _ = inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                      source.rope_freq_factors())
        return cls(cfg, first, end, layers, embed, final_norm, lm_head, inv_freq, dtype)

    @property
    def is_first(self) -> bool:
        return self.first == 0

    @property
    def is_last(self) -> bool:
        return self.end == self.config.num_layers

    @property
    def num_layers(self) -> int:
        return self.end - self.first

    def weight_bytes(self) -> int:
        total = sum(lw.nbytes() for lw in self.layers)
        seen = set()
        for t in (self.embed, self.final_norm, self.lm_head):
            if t is not None and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total

    def new_cache(self, max_tokens: int = 1 << 16) -> KVCache:
        return KVCache(self.config, self.num_layers, self.dtype, max_tokens)

    # -- forward --------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, kv: KVCache, seq_id, x: torch.Tensor, tree_mask: torch.Tensor | None = None,
                all_logits: bool = True, head: bool = True, return_normed: bool = False):
        """Append ``x`` (token ids on the first stage, hidden states otherwise) to ``seq_id``.

        Returns hidden states [n, hidden], or logits [n, vocab] on the last stage
        (only the final position's logits when ``all_logits`` is False; none at
        all with ``head=False``, for prompt chunks whose logits nobody reads).
        ``return_normed`` (last stage): also return the final-normed hidden
        states the LM head consumed, as ``(logits, normed)`` — Medusa heads draft
        from them without another pass through the model.
        """
        cfg = self.config
        past = kv.length(seq_id)
        n = x.shape[0]
        if past + n > cfg.max_position:
            raise ContextOverflow(
                f"sequence would reach {past + n} positions; the model's context is {cfg.max_position}")
        if cfg.sliding_window and past + n > cfg.sliding_window:
            raise ContextOverflow(
                f"sequence would reach {past + n} positions, beyond the sliding window {cfg.sliding_window}")
        if self.is_first:
            h = F.embedding(x, self.embed)
        else:
            h = x.to(self.dtype)
        causal = False
        if tree_mask is not None:
            positions = past + tree_depths(tree_mask)
            mask = with_prefix(tree_mask, past)
        else:
            positions = torch.arange(past, past + n)
            causal = n > 1 and past == 0  # let SDPA use its fused causal path
            mask = None if causal else chunk_mask(past, n)
        freqs = positions.to(torch.float32).unsqueeze(1) * self.inv_freq.unsqueeze(0)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)
        offset = kv.reserve(seq_id, n)
        for li, lw in enumerate(self.layers):
            h = self._layer(kv, seq_id, li, lw, h, cos, sin, mask, causal, offset, n)
        kv.commit(seq_id, n)
        if not self.is_last or not head:
            return h
        if not all_logits:
            h = h[-1:]
        h = rms_norm(h, self.final_norm, cfg.rms_eps)
        logits = linear(h, self.lm_head).float()
        return (logits, h) if return_normed else logits

    def _layer(self, kv, seq_id, li, lw: LayerWeights, h, cos, sin, mask, causal, offset, n):
        cfg = self.config
        hd, nh, nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        x = rms_norm(h, lw.attn_norm, cfg.rms_eps)
        qkv = linear(x, lw.qkv, lw.qkv_bias)
        q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        q = rotate(q.view(n, nh, hd).transpose(0, 1), cos, sin)
        k = rotate(k.view(n, nkv, hd).transpose(0, 1), cos, sin)
        v = v.view(n, nkv, hd).transpose(0, 1)
        kv.write(seq_id, li, offset, k, v)
        keys, values = kv.visible(seq_id, li, offset + n)
        attn = F.scaled_dot_product_attention(
            q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask, is_causal=causal,
            scale=self.scale, enable_gqa=nkv != nh,
        )[0]
        h = h + linear(attn.transpose(0, 1).reshape(n, nh * hd), lw.o)
        x = rms_norm(h, lw.mlp_norm, cfg.rms_eps)
        gate, up = linear(x, lw.gate_up).chunk(2, dim=-1)
        return h + linear(F.silu(gate) * up, lw.down)
