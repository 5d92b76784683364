"""A gguf-mode decode step: each layer in two kernel calls instead of ~25 torch operations.

Why: one row's small operations cost about as much per layer as its matrix products on a
small model (~0.6 ms a layer at one core), which put the embedded model's decode at 0.74x
llama.cpp's. ``native/decode_step.cpp`` runs a layer's attention half (norms, q/k/v, RoPE,
the cache write, attention, the output product, gate/up) in one call, torch's SwiGLU
follows, then the down product and residual in a second call.

Every step is the same function, in the same order, as the per-operation path
(:meth:`StageModel._layer`) takes for the same row, so a decode step here and the row in a
verify round or a prompt give the same bits; tests compare them.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from decoding.batch import BatchItem, RowPlan
from decoding.kv_cache import KVCache
from decoding.models.llama.layers import LayerWeights
from decoding.quant import native, row_ops
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
        # per layer: the C structs and the tensors they point into (kept alive with them)
        self.layers = [(ctypes.byref(lw.qkv.spec), ctypes.byref(lw.o.spec), ctypes.byref(lw.gate_up.spec),
                        ctypes.byref(lw.down.spec),
                        None if lw.qkv_bias is None else lw.qkv_bias.contiguous(),
                        lw.attn_norm.contiguous(), lw.mlp_norm.contiguous()) for lw in layers]

    @staticmethod
    def serves(stage) -> bool:
        """Whether ``stage``'s layers are all block matrices of a Llama block this kernel computes."""
        cfg = stage.config
        return (stage.packing == "gguf" and stage.device.type == "cpu" and cfg.num_heads % cfg.num_kv_heads == 0 and bool(stage.layers)
                and all(type(lw).norm_heads is LayerWeights.norm_heads
                        and all(isinstance(w, BlockLinear) for w in (lw.qkv, lw.o, lw.gate_up, lw.down))
                        for lw in stage.layers)
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
        elem = 4
        key_base = [k.data_ptr() for k, _, _ in spans]
        value_base = [v.data_ptr() for _, v, _ in spans]
        layer_step = [k.stride(0) * elem for k, _, _ in spans]
        segs, (keys, values, _, _) = row_ops.segment_pointers(key_base, value_base, [length for _, _, length in spans],
                                                              [k.stride(1) for k, _, _ in spans])
        own_k = spans[-1][0]
        at = p.offset * own_k.stride(2) * elem  # the new position in the sequence's own buffer
        dst_stride = own_k.stride(1)
        gate_up = torch.empty(1, 2 * self.inter)
        gate, up = gate_up[:, :self.inter], gate_up[:, self.inter:]
        scratch = torch.empty(self.hidden + self.qkv_width + self.nh * self.hd)
        threads = torch.get_num_threads()
        lib, hp, sp, gp = self.lib, h.data_ptr(), scratch.data_ptr(), gate_up.data_ptr()
        cp, snp, segp = cos.data_ptr(), sin.data_ptr(), ctypes.byref(segs)
        for li, (qkv, o, gu, down, bias, attn_norm, mlp_norm) in enumerate(self.layers):
            for j in range(n):
                keys[j] = key_base[j] + li * layer_step[j]
                values[j] = value_base[j] + li * layer_step[j]
            own = li * layer_step[-1] + at
            lib.meshd_decode_attention(qkv, None if bias is None else bias.data_ptr(), o, gu, attn_norm.data_ptr(),
                                       mlp_norm.data_ptr(), self.eps, hp, cp, snp, self.nh, self.nkv, self.hd,
                                       self.scale, segp, key_base[-1] + own, value_base[-1] + own, dst_stride, gp, sp,
                                       threads)
            act = F.silu(gate) * up
            lib.meshd_decode_down(down, act.data_ptr(), hp, sp, threads)
            self.stage.work_done += 1
        return h
