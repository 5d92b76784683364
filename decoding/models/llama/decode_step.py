"""A gguf-mode decode step: every layer of the stage in one kernel call instead of ~25 torch operations a layer.

Why: one row's small operations cost about as much per layer as its matrix products on a
small model (~0.6 ms a layer at one core), which put the embedded model's decode at 0.74x
llama.cpp's; two calls a layer with torch's SwiGLU between them still left ~1 ms of Python a
step. ``native/decode_step.cpp`` runs each layer (norms, q/k/v, RoPE, the cache write,
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
    """The layers of one gguf stage, prepared once for the two-call decode step."""

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
        # a member computing every head has the attention output whole: nothing to add up there
        self._reduce_attention = self._reduce if stage.attention_split else native.REDUCE_FN()

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
        """A lone decode row: one sequence, one row, no tree, no attention probe (the exits are the caller's)."""
        return (len(items) == 1 and plans[0].n == 1 and plans[0].mask is None
                and not (probes is not None and plans[0].probe_tail))

    def run(self, kv: KVCache, seq_id, p: RowPlan, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> torch.Tensor:
        """``h`` [1, hidden] through every layer; its key and value written at ``p.offset`` (reserved)."""
        h = h.to(torch.float32).contiguous().clone()  # updated in place: never the caller's (a message's) buffer
        cos, sin = cos.contiguous(), sin.contiguous()
        spans = kv.spans(seq_id, p.offset + 1)
        n = len(spans)
        ptrs, i64 = ctypes.c_void_p * n, ctypes.c_int64 * n
        own_k = spans[-1][0]
        gate_up = torch.empty(2 * self.inter)
        act = torch.empty(self.inter)
        scratch = torch.empty(self.hidden + self.qkv_width + self.nh * self.hd)
        self._failure = None
        failed = self.lib.meshd_decode_layers(
            len(self.specs), self.specs, self.eps, h.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            self.nh, self.nkv, self.hd, self.scale, n,
            ptrs(*(k.data_ptr() for k, _, _ in spans)), ptrs(*(v.data_ptr() for _, v, _ in spans)),
            i64(*(length for _, _, length in spans)), i64(*(k.stride(1) for k, _, _ in spans)),
            i64(*(k.stride(0) for k, _, _ in spans)), p.offset * own_k.stride(2), own_k.stride(1),
            gate_up.data_ptr(), act.data_ptr(), scratch.data_ptr(), torch.get_num_threads(), self._reduce_attention,
            self._reduce)
        if failed:
            raise self._failure or RuntimeError("the group's reduction failed")
        self.stage.work_done += len(self.specs)
        return h

    def _sum_over_group(self, ptr: int, n: int) -> int:
        """The kernel's callback at each split product: the partial sum summed over the group, in place.
        An exception cannot cross the C frames: it is kept, the kernel stops, and :meth:`run` raises it."""
        try:
            self.stage.group.sum_(np.ctypeslib.as_array((ctypes.c_float * n).from_address(ptr)))
            return 0
        except BaseException as exc:  # noqa: BLE001 (re-raised by run)
            self._failure = exc
            return 1
