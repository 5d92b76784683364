"""A gguf-mode decode step: every layer of the stage in one kernel call instead of ~25 torch operations a layer,
for one sequence's new row or for several sequences' (requests decoding together), their products taken at once.

Why: one row's small operations cost about as much per layer as its matrix products on a
small model (~0.6 ms a layer at one core), which put the embedded model's decode at 0.74x
llama.cpp's; two calls a layer with torch's SwiGLU between them still left ~1 ms of Python a
step. Several requests decoding together paid it too (the 1.5B: ~17 ms of a four-row step), and a
tensor group's member paid it between its exchanges. ``native/decode_step.cpp`` runs each layer (norms, q/k/v, RoPE, the cache write,
attention, the output product, gate/up, SwiGLU, down) and the layers in turn in one call.

Every step is the same function, in the same order, as the per-operation path
(:meth:`StageModel._layer`) takes for the same row, so a decode step here and the row in a
verify round or a prompt give the same bits; tests compare them.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from decoding.batch import BatchItem, RowPlan
from decoding.kv_cache import KVCache
from decoding.models.llama.layers import LayerWeights
from decoding.quant import native
from decoding.quant.blocks import BlockLinear


class DecodeSteps:
    """The layers of one gguf stage, prepared once for the decode step kernel."""

    def __init__(self, stage):
        cfg = stage.config
        self.stage = stage
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.eps, self.scale = float(cfg.rms_eps), float(stage.scale)
        self.hidden = cfg.hidden_size
        self.lib = native.library()
        layers = stage.layers
        self.inter = layers[0].gate_up.out_features // 2
        self.qkv_width = layers[0].qkv.out_features
        # the C structs of every layer and the tensors they point into (kept alive with them)
        self._keep = [(lw.qkv.spec, lw.o.spec, lw.gate_up.spec, lw.down.spec,
                       None if lw.qkv_bias is None else lw.qkv_bias.contiguous(),
                       lw.attn_norm.contiguous(), lw.mlp_norm.contiguous()) for lw in layers]
        addr = ctypes.addressof
        self.specs = (native.DecodeLayerSpec * len(layers))(*(
            native.DecodeLayerSpec(addr(qkv), None if bias is None else bias.data_ptr(), addr(o), addr(gu),
                                   addr(down), attn_norm.data_ptr(), mlp_norm.data_ptr())
            for qkv, o, gu, down, bias, attn_norm, mlp_norm in self._keep))
        # a tensor-parallel member hands its two partial sums a layer to its group from inside the step
        self._failure: BaseException | None = None
        self._reduce = native.REDUCE_FN(self._sum_over_group) if stage.group is not None else native.REDUCE_FN()

    @staticmethod
    def serves(stage) -> bool:
        """Whether ``stage``'s layers are all block matrices of a Llama block this kernel computes."""
        cfg = stage.config
        return (stage.packing == "gguf" and stage.device.type == "cpu" and cfg.num_heads % cfg.num_kv_heads == 0 and bool(stage.layers)
                and all(type(lw).norm_heads is LayerWeights.norm_heads
                        and all(isinstance(w, BlockLinear) for w in (lw.qkv, lw.o, lw.gate_up, lw.down))
                        for lw in stage.layers)
                # the step's buffers are sized once: every layer the same widths (the kernel reads them per layer)
                and len({(lw.qkv.out_features, lw.gate_up.out_features, lw.down.in_features, lw.o.out_features)
                         for lw in stage.layers}) == 1
                and stage.layers[0].gate_up.out_features == 2 * stage.layers[0].down.in_features
                and native.available()[0])

    @staticmethod
    def applies(items: list[BatchItem], plans: list[RowPlan], probes) -> bool:
        """Rows that each attend alone over the keys up to themselves: a decode step's, sequences decoding
        together, a verify round's chain (no tree, no whole position block, no attention probe; the exits
        are the caller's)."""
        return all(p.mask is None and not (p.whole is not None and bool(p.whole.any()))
                   and not (probes is not None and p.probe_tail) for p in plans)

    def run(self, kv: KVCache, items: list[BatchItem], plans: list[RowPlan], h: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor, layers: tuple[int, int] | None = None) -> torch.Tensor:
        """``h`` [rows, hidden], each item's ``n`` rows in turn, through every layer (or the stage's layers
        ``[lo, hi)``: a caller that reads the rows between layers runs the step in spans); each row's key and
        value written at its position (reserved from its plan's ``offset``) in its own sequence, before the row
        attends over its sequence's positions up to itself (a chain's later rows see the earlier ones)."""
        lo, hi = layers if layers is not None else (0, len(self.specs))
        h = h.to(torch.float32).contiguous().clone()  # updated in place: never the caller's (a message's) buffer
        cos, sin = cos.contiguous(), sin.contiguous()
        rows = h.shape[0]
        counts, keys, values, lengths, head_strides, steps, own, dst = [], [], [], [], [], [], [], []
        for it, p in zip(items, plans):
            for i in range(p.n):
                spans = kv.spans(it.seq_id, p.offset + i + 1)
                counts.append(len(spans))
                for k, v, length in spans:  # the span's layer ``lo`` is where the kernel's first layer starts
                    keys.append(k.data_ptr() + lo * k.stride(0) * k.element_size())
                    values.append(v.data_ptr() + lo * v.stride(0) * v.element_size())
                    lengths.append(length)
                    head_strides.append(k.stride(1))
                    steps.append(k.stride(0))
                own_k = spans[-1][0]
                own.append((p.offset + i) * own_k.stride(2))
                dst.append(own_k.stride(1))
        n = len(keys)
        ptrs, i64 = ctypes.c_void_p * n, ctypes.c_int64 * n
        per_row = ctypes.c_int64 * rows
        gate_up = torch.empty(rows, 2 * self.inter)
        act = torch.empty(rows, self.inter)
        scratch = torch.empty(rows, self.hidden + self.qkv_width + self.nh * self.hd)
        self._failure = None
        group = self.stage.group
        # a group whose links let the kernel exchange the partial sums itself: no trip through Python for each
        handle = group.native_sum() if group is not None else None
        reduce, ctx = handle if handle is not None else (self._reduce, None)
        # a member computing every head has the attention output whole: nothing to add up there
        reduce_attention, attention_ctx = (reduce, ctx) if self.stage.attention_split else (native.REDUCE_FN(), None)
        failed = self.lib.meshd_decode_layers(
            hi - lo, ctypes.addressof(self.specs) + lo * ctypes.sizeof(native.DecodeLayerSpec), self.eps, rows, h.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            self.nh, self.nkv, self.hd, self.scale, (ctypes.c_int * rows)(*counts), ptrs(*keys), ptrs(*values),
            i64(*lengths), i64(*head_strides), i64(*steps), per_row(*own), per_row(*dst),
            gate_up.data_ptr(), act.data_ptr(), scratch.data_ptr(), torch.get_num_threads(), reduce_attention,
            attention_ctx, reduce, ctx, ctypes.byref(self.stage.kernel_done))
        if handle is not None:
            group.native_done(bool(failed))  # the group's count of exchanges; GroupLost when it failed
        if failed:
            raise self._failure or RuntimeError("the group's reduction failed")
        return h

    def _sum_over_group(self, ctx, ptr: int, n: int) -> int:
        """The kernel's callback at each split product: the partial sum summed over the group, in place.
        An exception cannot cross the C frames: it is kept, the kernel stops, and :meth:`run` raises it."""
        try:
            # [rows, hidden], as the per-operation path hands its sums: a member on either path pairs up
            rows = np.ctypeslib.as_array((ctypes.c_float * n).from_address(ptr)).reshape(-1, self.hidden)
            self.stage.group.sum_(rows)
            return 0
        except BaseException as exc:  # noqa: BLE001 (re-raised by run)
            self._failure = exc
            return 1
