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

import ctypes
import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from decoding.attention import attention_tail, exact_attention, segmented_attention

# A forked sequence's chunk of this many rows or more attends over its segments joined (one fused call);
# fewer (a decode step) reads them in place (joining would copy the whole prefix for one row).
JOIN_SEGMENTS_FROM_ROWS = 16
from decoding.batch import BatchItem, RowPlan
from decoding.config import ModelConfig
from decoding.errors import ContextOverflow
from decoding.exits.owed import ExitedRows, OwedRow, rejoin
from decoding.kv_cache import KVCache
from decoding.linear import linear, nbytes
from decoding.masks import chunk_mask
from decoding.head_rows import HeadRows
from decoding.models.llama.decode_step import DecodeSteps
from decoding.models.llama.layers import LayerWeights, rms_norm, rotate
from decoding.quant import row_ops
from decoding.tensor_group import best_rows


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
        self.exits = None  # BoundExits (decoding.exits.bound): early exits inside this stage's layers, if any
        self.exited = ExitedRows()  # exited rows whose later layers still owe KV
        # Rows x layers computed so far (:attr:`work_done`): the per-operation path's, and the decode step
        # kernel's, which grows it layer by layer from inside its one call
        self._work_done = 0
        self.kernel_done = ctypes.c_int64(0)
        self._decode_steps: DecodeSteps | None | bool = None  # built on the first decode step
        # A tensor-parallel member (decoding.models.llama.tensor_slice): the group that adds up its partial sums,
        # and the first of the vocabulary rows its head holds
        self.group = None
        self.vocab_start = 0
        # whether the attention output is a partial sum too (False: this member computes every head)
        self.attention_split = True

    def join_group(self, group, attention_split: bool = True) -> None:
        """This stage is one member's share of a layer range; ``group`` adds up what the members computed.
        ``attention_split`` False: the member computes every head (only the MLP and the head are split)."""
        self.group = group
        self.attention_split = attention_split
        self._decode_steps = None

    def _summed(self, x: torch.Tensor) -> torch.Tensor:
        """A member's partial output of a split product, summed over its group (in place); else ``x``."""
        if self.group is not None:
            self.group.sum_(x.numpy())
        return x

    @classmethod
    def from_source(cls, source, first: int, end: int, dtype: torch.dtype = torch.float32,
                    device: torch.device | str | None = None, packed: str | bool = "") -> "StageModel":
        """Load ``[first, end)`` from ``source`` (see ``decoding.models.llama.loader.load_stage``)."""
        from decoding.models.llama.loader import load_stage

        return load_stage(cls, source, first, end, dtype, device, packed)

    def view(self, layers: list[LayerWeights], first: int, end: int, embed=None, final_norm=None,
             lm_head=None) -> "StageModel":
        """A stage over some of these tensors ([first, end) decides which ends run) computed as this stage
        computes them: the same numeric mode, so the profiler times the path serving takes."""
        v = StageModel(self.config, first, end, layers, embed, final_norm, lm_head, self.inv_freq, self.dtype)
        v.formats, v.scratch, v.packing = self.formats, self.scratch, self.packing
        return v

    @property
    def packed(self) -> bool:
        """Whether this stage's matrices are packed (a packed numeric mode; :attr:`packing` says which)."""
        return bool(self.packing)

    @property
    def work_done(self) -> int:
        """Rows x layers computed so far. It grows layer by layer, so another thread can see a long pass
        advance (a stage tells the coordinators waiting on it; see meshd.pipeline.stage.progress)."""
        return self._work_done + self.kernel_done.value

    @property
    def decode_steps(self) -> DecodeSteps | None:
        """The gguf mode's decode step kernel for these layers (None: the per-operation path serves)."""
        if self._decode_steps is None:
            self._decode_steps = DecodeSteps(self) if DecodeSteps.serves(self) else False
        return self._decode_steps or None

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
    def forward_batch(self, kv: KVCache, items: list[BatchItem], probes: dict[int, torch.Tensor] | None = None,
                      taps: dict[int, Callable[[torch.Tensor], None]] | None = None) -> list:
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

        ``taps``: after the model's layer count L (a key inside this stage's layers), ``taps[L](h)``
        sees the hidden states of every row still running, [rows, hidden] in the items' order,
        before the next layer (read-only: copy what you keep). A cloud verifier previews its
        verdicts there, from exit heads, while its last layers still run.
        """
        self.check_positions(kv, items)
        if self.exited:  # a sequence's exited row finishes its layers before its next rows attend to them
            broken = self.fill_pending(kv, {it.seq_id for it in items})
            if broken:
                raise RuntimeError(f"the layers an early exit skipped could not be computed for {broken[0]!r}")
        cfg, device = self.config, self.device
        items = [it.on(device) for it in items]  # a CPU stage after a GPU one gets GPU tensors too
        plans = [RowPlan.of(it, kv.length(it.seq_id), device, exact=bool(self.packing)) for it in items]
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
        if self.packing:  # which rows take the dense path in every matrix product (see RowPlan.of)
            dense = torch.cat([p.whole for p in plans]) if len(plans) > 1 else plans[0].whole
        exits = self.exits if self.exits is not None and any(it.may_exit for it in items) else None
        everyone, exited = (items, plans), {}
        steps = self.decode_steps if exits is None and DecodeSteps.applies(items, plans, probes) else None
        tapped = sorted(li - self.first for li in (taps or ()) if self.first < li < self.end)
        if steps is not None:  # the gguf mode's lone rows (decode steps, chains): the layers in one kernel call
            for lo, hi in zip([0, *tapped], [*tapped, len(self.layers)]):  # a span between taps per call
                h = steps.run(kv, items, plans, h, cos, sin, (lo, hi))
                if hi in tapped:
                    taps[self.first + hi](h)
        for li, lw in enumerate(self.layers if steps is None else ()):
            h = self._layer(kv, li, lw, h, cos, sin, items, plans, probes, dense)
            self._work_done += h.shape[0]
            if li + 1 in tapped:
                taps[self.first + li + 1](h)
            if exits is not None and li in exits.at:
                h, (cos, sin, dense), items, plans = self.exited.leave(exits, li, h, (cos, sin, dense), items, plans,
                                                                       exited)
                if not items:  # every row left: the rest of the layers are the fill's
                    break
        items, plans = everyone
        for p, it in zip(plans, items):
            kv.commit(it.seq_id, p.n)
        parts = rejoin(h, items, plans, exited) if exited else h.split([p.n for p in plans])
        heading = [(part, it) for part, it in zip(parts, items) if it.head and it.seq_id not in exited]
        read = [(part[-it.logit_rows:] if it.logit_rows else part) if it.all_logits else part[-1:]
                for part, it in heading]
        if not self.is_last or not read:
            return list(parts)
        # The LM head only over the rows someone reads: one product for the whole batch, but for the
        # items that read their rows later, and perhaps only a grammar's tokens of them (HeadRows).
        normed = rms_norm(torch.cat(read), self.final_norm, cfg.rms_eps)
        normed_parts = normed.split([r.shape[0] for r in read])
        lazy = [it.lazy_head and self.selectable_head for _, it in heading]
        eager = [nm for nm, lz in zip(normed_parts, lazy) if not lz]
        # (a packed head multiplies every row alone: widening a 152k-row head would cost more than it saves)
        best = all(it.best_only for (_, it), lz in zip(heading, lazy) if not lz)
        logits = iter(self._head(torch.cat(eager), best).split([e.shape[0] for e in eager]) if eager else ())
        heads = iter(zip(normed_parts, lazy))
        outs: list = []
        for part, it in zip(parts, items):
            if not it.head or it.seq_id in exited:
                outs.append(part)
                continue
            nm, lz = next(heads)
            lg = HeadRows(nm, self.lm_head, cfg.vocab_size) if lz else next(logits)
            outs.append((lg, nm) if it.return_normed else lg)
        return outs

    def _head(self, normed: torch.Tensor, best_only: bool = False) -> torch.Tensor:
        """Logits of final-normed rows; a group member's vocabulary rows gathered into whole rows. ``best_only``
        (every row is read for its best token alone): a group gathers each member's best instead, a few
        bytes a row instead of its share of the vocabulary (304 KB a row of Qwen's over two members), and
        the row holds that token's logit and -inf elsewhere: the token one device's argmax picks."""
        logits = linear(normed, self.lm_head, dense=False).float()
        if self.group is None:
            return logits
        if not best_only:
            return torch.from_numpy(self.group.gather(logits.contiguous().numpy()))
        value, index = logits.max(dim=-1)  # the first of equal maxima, as argmax over the whole row
        mine = torch.stack([value, (index + self.vocab_start).float(), torch.full_like(value, logits.shape[-1])], -1)
        parts = self.group.gather_parts(mine.contiguous().numpy())
        return logits if parts is None else best_rows(parts, self.config.vocab_size)

    def check_positions(self, kv: KVCache, items: list[BatchItem]) -> None:
        """Refuse ``items`` before anything is computed: a sequence twice in one batch, one unknown to
        ``kv`` (CacheError), or one that would pass the model's context or sliding window."""
        if len({it.seq_id for it in items}) != len(items):
            raise ValueError("a sequence may appear only once in a batch")
        cfg = self.config
        for it in items:
            past, n = kv.length(it.seq_id), it.x.shape[0]
            if past + n > cfg.max_position:
                raise ContextOverflow(
                    f"sequence would reach {past + n} positions; the model's context is {cfg.max_position}")
            if cfg.sliding_window and past + n > cfg.sliding_window:
                raise ContextOverflow(
                    f"sequence would reach {past + n} positions, beyond the sliding window {cfg.sliding_window}")

    @property
    def selectable_head(self) -> bool:
        """Whether the head can multiply a row over chosen tokens only, with the full product's bits
        (the ``gguf`` mode's block matrices: a row's result depends on its own blocks alone). A group
        member's head holds only its share of the tokens: it gathers whole rows instead."""
        return self.lm_head is not None and hasattr(self.lm_head, "only") and self.group is None

    # -- early exits (decoding.exits.owed) ----------------------------------------------
    def has_pending(self) -> bool:
        return bool(self.exited)

    @torch.inference_mode()
    def fill_pending(self, kv: KVCache, seqs=None) -> list:
        """Run the layers exited rows skipped (all, or only ``seqs``'); returns the sequences whose fill
        failed (see :meth:`ExitedRows.fill`)."""
        return self.exited.fill(kv, len(self.layers), lambda li, h, row: self._owed_layer(kv, li, h, row), seqs)

    def _owed_layer(self, kv: KVCache, li: int, h: torch.Tensor, row: OwedRow) -> torch.Tensor:
        cos, sin, dense = row.rows
        return self._layer(kv, li, self.layers[li], h, cos, sin, [row.item], [row.plan], None, dense)

    def drop_pending(self) -> None:
        """A new cache (a new plan): nothing is owed to the old one."""
        self.exited.drop()

    def _layer(self, kv, li, lw: LayerWeights, h, cos, sin, items, plans, probes=None, dense=None):
        cfg = self.config
        hd, nh, nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        total = h.shape[0]
        fused = self.packing == "gguf"  # the row steps as single kernel calls (decoding.quant.row_ops)
        x = (row_ops.rms_norm if fused else rms_norm)(h, lw.attn_norm, cfg.rms_eps)
        qkv = linear(x, lw.qkv, lw.qkv_bias, dense)
        q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        q, k = lw.norm_heads(q.view(total, nh, hd), k.view(total, nkv, hd), cfg.rms_eps)
        if fused:
            q, k = row_ops.rope_(q, cos, sin).transpose(0, 1), row_ops.rope_(k, cos, sin).transpose(0, 1)
        else:
            q = rotate(q.transpose(0, 1), cos, sin)
            k = rotate(k.transpose(0, 1), cos, sin)
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
        out = linear(attn.transpose(0, 1).reshape(total, nh * hd), lw.o, None, dense)
        h = h + (self._summed(out) if self.attention_split else out)
        x = (row_ops.rms_norm if fused else rms_norm)(h, lw.mlp_norm, cfg.rms_eps)
        gate_up = linear(x, lw.gate_up, None, dense)
        if fused:
            return h + self._summed(linear(row_ops.swiglu(gate_up), lw.down, None, dense))
        gate, up = gate_up.chunk(2, dim=-1)
        return h + self._summed(linear(F.silu(gate) * up, lw.down, None, dense))

    def _attend(self, kv: KVCache, li: int, seq_id, p: RowPlan, q, k, v, probes=None) -> torch.Tensor:
        """One sequence's attention, [heads, n, head_dim]: its new keys written, then read in place."""
        nh, nkv = self.config.num_heads, self.config.num_kv_heads
        kv.write(seq_id, li, p.offset, k, v)
        segments = kv.segments(seq_id, li, p.offset + p.n)
        probing = p.probe_tail and probes is not None
        if p.exact and not probing:
            # (a forked sequence's rows get the very bits an unforked one gets: a prefix cache must not
            # change an answer)
            return exact_attention(p, q, segments, self.scale, nkv != nh)
        if len(segments) > 1 and not probing and p.n >= JOIN_SEGMENTS_FROM_ROWS:
            # A forked sequence (a cached prefix, an outline's prompt) read as one run of keys: a prefill
            # chunk gets the fused kernel. The copy is one layer's keys and values, dwarfed by a chunk's
            # attention over them.
            segments = [(torch.cat([k for k, _ in segments], dim=1), torch.cat([v for _, v in segments], dim=1))]
        if p.exact and p.mask is None:  # a forked sequence (shared prefix): one chunk mask for its rows
            p = dataclasses.replace(p, mask=chunk_mask(p.past, p.n, q.device))
        if p.probe_tail and probes is not None and li == len(self.layers) - 1:
            probes[p.probe_index] = attention_tail(q, segments, p, p.probe_tail, self.scale)
        if len(segments) == 1:
            keys, values = segments[0]
            return F.scaled_dot_product_attention(
                q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), attn_mask=p.mask, is_causal=p.causal,
                scale=self.scale, enable_gqa=nkv != nh)[0]
        return segmented_attention(q, segments, p.mask, self.scale)
