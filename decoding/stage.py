"""One pipeline stage: a contiguous range [first, end) of a Llama-family decoder.

A plain-torch forward (RMSNorm, RoPE, grouped-query attention through
scaled_dot_product_attention, SwiGLU MLP) so that the same code runs the whole
model on one device or any slice of it on many. The first stage embeds token
ids; the last applies the final norm and the LM head; every stage appends the
new positions to its own KV cache.

A stage lives on one device (``decoding.device``): its weights, KV cache,
positions, RoPE tables and masks are all there. Inputs are moved to it once per
forward; outputs stay on it (the caller moves them to the host once per message),
so consecutive stages on one GPU pass activations without a host round trip.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from decoding.config import ModelConfig
from decoding.device import CPU
from decoding.errors import ContextOverflow, ModelLoadError
from decoding.linear import PackedLinear, Weight, linear, nbytes
from decoding.quant.packed import DENSE_FROM_ROWS

#: Positions a packed stage computes as one block (see _RowPlan.of); the dense regime's row count.
EXACT_BLOCK = DENSE_FROM_ROWS
from decoding.kv_cache import KVCache
from decoding.loader.rope import inv_frequencies
from decoding.masks import chunk_mask, tree_depths, with_prefix


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    qkv: Weight  # fused [q; k; v] rows: one matmul instead of three
    qkv_bias: torch.Tensor | None
    o: Weight
    mlp_norm: torch.Tensor
    gate_up: Weight  # fused [gate; up]
    down: Weight

    def nbytes(self) -> int:
        return sum(nbytes(w) for w in (self.attn_norm, self.qkv, self.qkv_bias, self.o, self.mlp_norm,
                                        self.gate_up, self.down))


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
        # The device is where the weights are (a view built from another stage's tensors follows them).
        weights = (embed, lm_head, final_norm, *(lw.attn_norm for lw in layers[:1]))
        self.device = next((t.device for t in weights if t is not None), inv_freq.device)
        self.inv_freq = inv_freq if inv_freq.device == self.device else inv_freq.to(self.device)
        self.dtype = dtype
        self.scale = config.head_dim ** -0.5
        self.formats: dict[str, str] = {}  # tensor -> how it is held, when not simply ``dtype``
        self.scratch = None  # packed stages: the buffer matrices are widened into for long prompts
        self.packing = ""  # "", "packed" or "packed4" (decoding.device.PACKINGS)

    # -- construction -------------------------------------------------------------
    @classmethod
    def from_source(cls, source, first: int, end: int, dtype: torch.dtype = torch.float32,
                    device: torch.device | str | None = None, packed: str | bool = "") -> "StageModel":
        """Load ``[first, end)`` from ``source`` in ``dtype`` onto ``device`` (default: the CPU).

        Tensors are read (dequantised) on the host a few at a time and each is cast
        and moved in one step, so loading onto a GPU never holds a host copy of
        the whole stage. ``packed`` (a packed numeric mode, "packed" or "packed4",
        bfloat16 on the CPU): every matrix is held as 4- or 8-bit groups instead
        (see :func:`_load_packed`) and the token embedding as the file stores it.
        """
        cfg = source.config
        if not 0 <= first < end <= cfg.num_layers:
            raise ModelLoadError(
                f"{source.path}: invalid layer range [{first}, {end}) for a {cfg.num_layers}-layer model")
        device = CPU if device is None else torch.device(device)
        packing = "packed" if packed is True else (packed or "")
        if packing:
            return _load_packed(cls, source, first, end, dtype, device, packing)
        cast = lambda t: t.to(device=device, dtype=dtype).contiguous()  # noqa: E731
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
        return cls(cfg, first, end, layers, embed, final_norm, lm_head, inv_freq.to(device), dtype)

    @property
    def packed(self) -> bool:
        """Whether this stage's matrices are packed (a packed numeric mode; :attr:`packing` says which)."""
        return bool(self.packing)

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
            if t is not None and id(t) not in seen:  # a tied head is the embedding itself
                seen.add(id(t))
                total += nbytes(t)
        return total

    def new_cache(self, max_tokens: int = 1 << 16) -> KVCache:
        return KVCache(self.config, self.num_layers, self.dtype, max_tokens, self.device)

    # -- forward --------------------------------------------------------------------
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
        return self.forward_batch(kv, [BatchItem(seq_id, x, tree_mask, all_logits, head, return_normed)])[0]

    @torch.inference_mode()
    def forward_batch(self, kv: KVCache, items: "list[BatchItem]", probes: dict[int, torch.Tensor] | None = None
                      ) -> list:
        """Run several sequences' new tokens in one pass; returns what :meth:`forward` would, per item.

        The weights are read once for all rows (on a CPU, decode is bound by
        reading them: four sequences' steps cost little more than one), while
        each sequence attends only to its own keys — ragged, one attention call
        per sequence, so nobody's cache is copied into a padded batch. A
        sequence may appear once per batch (its rows must see each other's keys
        in order); the caller runs a second message for it in the next batch.

        Inputs (token ids, hidden states, tree masks) may come from the host: a
        stage off the CPU moves them here once per item. Outputs stay on the
        stage's device; the caller moves what it keeps to the host.

        ``probes`` (last stage): for each item with ``attention_tail`` = W > 0,
        ``probes[index]`` receives [rows, W]: the final layer's attention, averaged
        over heads, that each new row pays to the sequence's last W positions. An
        edge device asks for it to judge how much later tokens lean on a drafted
        chunk (the importance half of deciding what a cloud verifier should see).
        """
        if len({it.seq_id for it in items}) != len(items):
            raise ValueError("a sequence may appear only once in a batch")
        cfg, device = self.config, self.device
        items = [it.on(device) for it in items]  # a CPU stage after a GPU one gets GPU tensors too
        plans = []
        for it in items:
            past, n = kv.length(it.seq_id), it.x.shape[0]
            if past + n > cfg.max_position:
                raise ContextOverflow(
                    f"sequence would reach {past + n} positions; the model's context is {cfg.max_position}")
            if cfg.sliding_window and past + n > cfg.sliding_window:
                raise ContextOverflow(
                    f"sequence would reach {past + n} positions, beyond the sliding window {cfg.sliding_window}")
            plans.append(_RowPlan.of(it, past, device, exact=bool(self.packing)))
        if self.is_first:
            ids = torch.cat([it.x for it in items]) if len(items) > 1 else items[0].x
            h = F.embedding(ids, self.embed) if isinstance(self.embed, torch.Tensor) else self.embed.lookup(ids)
        else:
            h = torch.cat([it.x for it in items]).to(self.dtype) if len(items) > 1 else items[0].x.to(self.dtype)
        positions = torch.cat([p.positions for p in plans]) if len(plans) > 1 else plans[0].positions
        freqs = positions.to(torch.float32).unsqueeze(1) * self.inv_freq.unsqueeze(0)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)
        for p, it in zip(plans, items):
            p.offset = kv.reserve(it.seq_id, p.n)
        if probes is not None and self.is_last:
            for i, (p, it) in enumerate(zip(plans, items)):
                p.probe_tail, p.probe_index = it.attention_tail, i
        dense = None
        if self.packing:  # which rows take the dense path in every matrix product (see _RowPlan.of)
            dense = torch.cat([p.whole for p in plans]) if len(plans) > 1 else plans[0].whole
        for li, lw in enumerate(self.layers):
            h = self._layer(kv, li, lw, h, cos, sin, items, plans, probes, dense)
        for p, it in zip(plans, items):
            kv.commit(it.seq_id, p.n)
        parts = h.split([p.n for p in plans])
        read = [(part[-it.logit_rows:] if it.logit_rows else part) if it.all_logits else part[-1:]
                for part, it in zip(parts, items) if it.head]
        if not self.is_last or not read:
            return list(parts)
        # The LM head only over the rows someone reads: one product for the whole batch.
        normed = rms_norm(torch.cat(read), self.final_norm, cfg.rms_eps)
        # (a packed head multiplies every row alone: widening a 152k-row head would cost more than it saves)
        logits = linear(normed, self.lm_head, dense=False).float()
        sizes = [r.shape[0] for r in read]
        heads = iter(zip(logits.split(sizes), normed.split(sizes)))
        outs: list = []
        for part, it in zip(parts, items):
            if not it.head:
                outs.append(part)
                continue
            lg, nm = next(heads)
            outs.append((lg, nm) if it.return_normed else lg)
        return outs

    def _layer(self, kv, li, lw: LayerWeights, h, cos, sin, items, plans, probes=None, dense=None):
        cfg = self.config
        hd, nh, nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        total = h.shape[0]
        x = rms_norm(h, lw.attn_norm, cfg.rms_eps)
        qkv = linear(x, lw.qkv, lw.qkv_bias, dense)
        q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        q = rotate(q.view(total, nh, hd).transpose(0, 1), cos, sin)
        k = rotate(k.view(total, nkv, hd).transpose(0, 1), cos, sin)
        v = v.view(total, nkv, hd).transpose(0, 1)
        if len(items) == 1:
            attn = self._attend(kv, li, items[0].seq_id, plans[0], q, k, v, probes)
        else:
            parts, start = [], 0
            for it, p in zip(items, plans):
                end = start + p.n
                parts.append(self._attend(kv, li, it.seq_id, p, q[:, start:end], k[:, start:end], v[:, start:end],
                                          probes))
                start = end
            attn = torch.cat(parts, dim=1)
        h = h + linear(attn.transpose(0, 1).reshape(total, nh * hd), lw.o, None, dense)
        x = rms_norm(h, lw.mlp_norm, cfg.rms_eps)
        gate, up = linear(x, lw.gate_up, None, dense).chunk(2, dim=-1)
        return h + linear(F.silu(gate) * up, lw.down, None, dense)

    def _attend(self, kv: KVCache, li: int, seq_id, p: "_RowPlan", q, k, v, probes=None) -> torch.Tensor:
        """One sequence's attention, [heads, n, head_dim]: its new keys written, then read in place."""
        nh, nkv = self.config.num_heads, self.config.num_kv_heads
        kv.write(seq_id, li, p.offset, k, v)
        segments = kv.segments(seq_id, li, p.offset + p.n)
        if p.exact and len(segments) == 1 and not (p.probe_tail and probes is not None):
            return self._attend_exact(p, q, *segments[0])
        if p.exact and p.mask is None:  # a forked sequence (shared prefix): one chunk mask for its rows
            p = dataclasses.replace(p, mask=chunk_mask(p.past, p.n, q.device))
        if p.probe_tail and probes is not None and li == len(self.layers) - 1:
            probes[p.probe_index] = self._attention_tail(q, segments, p, p.probe_tail)
        if len(segments) == 1:
            keys, values = segments[0]
            return F.scaled_dot_product_attention(
                q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), attn_mask=p.mask, is_causal=p.causal,
                scale=self.scale, enable_gqa=nkv != nh)[0]
        return segmented_attention(q, segments, p.mask, self.scale)


    def _attend_exact(self, p: "_RowPlan", q, keys, values) -> torch.Tensor:
        """Attention that gives each row the same bits however its sequence was cut or batched.

        A whole position block attends in one call over exactly the keys up to its
        end; any other row attends alone over the keys up to itself, as a decode
        step does. CPU SDPA's result for a row does depend on the other rows of the
        call (its tiles), so these are the only two shapes of call a row ever sees.
        """
        nh, nkv = self.config.num_heads, self.config.num_kv_heads
        gqa = nkv != nh
        outs, i = [], 0
        whole = p.whole.tolist()
        while i < p.n:
            if p.mask is not None:  # a tree node: its ancestors and itself
                sel = p.mask[i].nonzero().squeeze(1)
                k_i, v_i, rows = keys[:, sel], values[:, sel], 1
                mask = None
            elif whole[i]:
                rows, end = EXACT_BLOCK, p.past + i + EXACT_BLOCK
                k_i, v_i = keys[:, :end], values[:, :end]
                mask = torch.arange(end, device=q.device).unsqueeze(0) <= p.positions[i:i + rows].unsqueeze(1)
            else:
                rows, end = 1, p.past + i + 1
                k_i, v_i, mask = keys[:, :end], values[:, :end], None
            outs.append(F.scaled_dot_product_attention(
                q[:, i:i + rows].contiguous().unsqueeze(0), k_i.unsqueeze(0), v_i.unsqueeze(0), attn_mask=mask,
                scale=self.scale, enable_gqa=gqa)[0])
            i += rows
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def _attention_tail(self, q: torch.Tensor, segments, p: "_RowPlan", width: int) -> torch.Tensor:
        """[n, width]: head-averaged attention of the new rows on the last ``width`` positions."""
        nh, n, hd = q.shape
        nkv = segments[0][0].shape[0]
        qg = q.reshape(nkv, (nh // nkv) * n, hd)
        scores = torch.cat([torch.matmul(qg, k.transpose(-1, -2)) for k, _ in segments], dim=-1)
        scores = scores.view(nkv, nh // nkv, n, -1).float() * self.scale
        mask = p.mask if p.mask is not None else chunk_mask(0, n, q.device) if p.causal else None
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).mean(dim=(0, 1))  # [n, positions]
        tail = probs[:, -width:]
        if tail.shape[1] < width:  # fewer positions than asked: pad on the left
            tail = F.pad(tail, (width - tail.shape[1], 0))
        return tail


def _load_packed(cls, source, first: int, end: int, dtype: torch.dtype, device: torch.device,
                 packing: str) -> StageModel:
    """``[first, end)`` with every matrix packed (``decoding.quant``), sharing one scratch buffer.

    What each tensor becomes (``formats`` records it, per tensor):

    ========================  ============================  ===========================
    stored in the file as     ``packed``                    ``packed4``
    ========================  ============================  ===========================
    Q4_0, Q4_1, Q4_K          4-bit, its own codes          4-bit, its own codes
    Q8_0, Q5_0                8-bit (two planes), own codes 4-bit, rounded
    Q6_K, F16, F32, others    8-bit, rounded (finer than    4-bit, rounded
                              the file's own steps)
    ========================  ============================  ===========================

    Only scales and offsets change format (bfloat16) where codes are kept. The
    token embedding stays as the file stores it and is widened per lookup.
    """
    from decoding.quant.groups import Int4Groups, requantize, requantize_8bit
    from decoding.quant.packed import ConcatLinear, Scratch
    from decoding.quant.rows import QuantRows

    if device.type != "cpu":
        raise ModelLoadError(f"the packed numeric modes run on the CPU; {device} takes bfloat16 or float16")
    if packing not in ("packed", "packed4"):
        raise ValueError(f"unknown packing {packing!r} (packed, packed4)")
    cfg = source.config
    scratch = Scratch()
    formats: dict[str, str] = {}
    cast = lambda t: t.to(dtype=dtype).contiguous()  # noqa: E731
    kind_of = getattr(source, "tensor_type", lambda n: None)
    four_bit_of = getattr(source, "read_int4_groups", lambda n: None)
    eight_bit_of = getattr(source, "read_int8_planes", lambda n: None)

    def planes(name: str, key: str) -> list[Int4Groups]:
        kind = kind_of(name) or "float"
        exact = four_bit_of(name)
        if exact is not None:
            formats[key] = f"int4 ({kind}, its own codes)"
            return [exact]
        if packing == "packed4":
            formats[key] = f"int4 (rounded from {kind})"
            return [requantize(source.read_tensor(name))]
        kept = eight_bit_of(name)
        if kept is not None:
            formats[key] = f"int8 ({kind}, its own codes)"
            return list(kept)
        formats[key] = f"int8 (rounded from {kind})"
        return list(requantize_8bit(source.read_tensor(name)))

    def packed(*names: str, key: str = ""):
        parts = [planes(n, key or n) for n in names]
        if len({len(p) for p in parts}) == 1:  # same width: one matrix, one product
            return PackedLinear([Int4Groups.concat([p[i] for p in parts]) for i in range(len(parts[0]))], scratch)
        return ConcatLinear([PackedLinear(p, scratch) for p in parts])

    layers = []
    for i in range(first, end):
        p = f"layers.{i}."
        r = lambda n: source.read_tensor(p + n)  # noqa: E731
        bias = cast(torch.cat([r("q_bias"), r("k_bias"), r("v_bias")])) if cfg.attention_bias else None
        layers.append(LayerWeights(
            attn_norm=cast(r("attn_norm")), qkv=packed(p + "q", p + "k", p + "v"), qkv_bias=bias,
            o=packed(p + "o"), mlp_norm=cast(r("mlp_norm")), gate_up=packed(p + "gate", p + "up"),
            down=packed(p + "down")))
    embed = final_norm = lm_head = None
    if end == cfg.num_layers:
        final_norm = cast(source.read_tensor("final_norm"))
        lm_head = packed("embed" if cfg.tie_embeddings else "lm_head", key="lm_head")
    if first == 0 and cfg.tie_embeddings:
        # One matrix, as in the file, and the same values wherever it is held: a first stage that is
        # not the last looks rows up in the packed matrix the last stage multiplies by, so a mesh
        # embeds exactly as one device does.
        embed = lm_head if lm_head is not None else packed("embed", key="lm_head")
        formats["embed"] = "the LM head's rows, widened per lookup"
    elif first == 0:
        if hasattr(source, "read_row_blocks"):
            embed = QuantRows(*source.read_row_blocks("embed"), dtype)
            formats["embed"] = f"{embed.type_name} rows, widened per lookup"
        else:
            embed = cast(source.read_tensor("embed"))
    inv_freq, _ = inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, source.rope_freq_factors())
    stage = cls(cfg, first, end, layers, embed, final_norm, lm_head, inv_freq, dtype)
    stage.formats, stage.scratch, stage.packing = formats, scratch, packing
    return stage


@dataclass(frozen=True)
class BatchItem:
    """One sequence's share of a batched forward (the arguments of :meth:`StageModel.forward`)."""

    seq_id: object
    x: torch.Tensor
    tree_mask: torch.Tensor | None = None
    all_logits: bool = True
    head: bool = True
    return_normed: bool = False
    logit_rows: int = 0  # with all_logits: only the last this many rows (0: all)
    attention_tail: int = 0  # see StageModel.forward_batch's ``probes``

    @property
    def tokens(self) -> int:
        return int(self.x.shape[0])

    def on(self, device: torch.device) -> "BatchItem":
        """This item with its tensors on ``device`` (the one host-to-device copy of a message)."""
        mask = self.tree_mask
        if self.x.device == device and (mask is None or mask.device == device):
            return self
        return dataclasses.replace(self, x=self.x.to(device),
                                   tree_mask=None if mask is None else mask.to(device))


@dataclass
class _RowPlan:
    n: int
    positions: torch.Tensor
    mask: torch.Tensor | None
    causal: bool
    offset: int = 0
    probe_tail: int = 0
    probe_index: int = 0
    past: int = 0
    exact: bool = False  # a packed stage: each row computed the same way whatever came with it
    whole: torch.Tensor | None = None  # exact, bool [n]: rows of whole EXACT_BLOCK position blocks

    @classmethod
    def of(cls, it: BatchItem, past: int, device: torch.device, exact: bool = False) -> "_RowPlan":
        """Positions and mask of ``it``'s rows, built on the stage's ``device`` (a tree mask is already there).

        ``exact`` (packed stages): a row's result must not depend on how the
        sequence was cut into messages, nor on what was batched with it. Rows that
        fill a whole block of EXACT_BLOCK positions ``[64 k, 64 k + 64)`` take the
        dense path together (a prompt, however it is cut at block boundaries); every
        other row (decode steps, verify rounds, a prompt's last partial block, tree
        nodes) is computed alone, the way one decode step is.
        """
        n = it.x.shape[0]
        if it.tree_mask is not None:
            return cls(n, past + tree_depths(it.tree_mask), with_prefix(it.tree_mask, past), False, past=past,
                       exact=exact, whole=torch.zeros(n, dtype=torch.bool) if exact else None)
        positions = torch.arange(past, past + n, device=device)
        if exact:
            first = -(-past // EXACT_BLOCK) * EXACT_BLOCK  # the first block boundary at or after past
            last = (past + n) // EXACT_BLOCK * EXACT_BLOCK  # the last one at or before the end
            pos = torch.arange(past, past + n)
            return cls(n, positions, None, False, past=past, exact=True, whole=(pos >= first) & (pos < last))
        causal = n > 1 and past == 0  # let SDPA use its fused causal path
        return cls(n, positions, None if causal else chunk_mask(past, n, device), causal)


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
