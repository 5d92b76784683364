"""Candidates for integer kernels on 4-bit blocks (issue #46), one matrix product at a time.

Every candidate multiplies the same 4-bit weights (symmetric, one scale per 32 inputs, as
GGUF's Q4_0 blocks hold them) by M rows of activations, on one thread, for the matrix shapes of
Qwen2.5-1.5B (FFN gate/up: 1536 -> 8960; down: 8960 -> 1536) and M = 1 (a decode step),
8 (a verify round, a few sequences) and 512 (a prompt block). Reported per candidate and M:
the median time of one product, the weight bytes it read per second (the decode bound) and
its arithmetic rate, its distance from float32 on the same (dequantized) weights, and whether
a row's result is the same alone and among M rows (the exactness rule every meshd mode keeps).

  float32            torch F.linear on the dequantized matrix (meshd's float32 mode)
  torch-int4-bf16    torch's _weight_int4pack_mm_for_cpu, bfloat16 activations (meshd's packed mode, few rows)
  torch-bf16-dense   the matrix widened to bfloat16, F.linear (packed mode's prompt path)
  torch-dyn-quant    torch's _dyn_quant_matmul_4bit (int8 activations; KleidiAI on ARM)
  ort-int8           onnxruntime MatMulNBits, accuracy_level 4: activations quantized to int8 per
                     block, integer dot products (MLAS: AVX2, AVX-VNNI, AVX-512 VNNI, NEON dotprod)
  ort-fp32           onnxruntime MatMulNBits, accuracy_level 1: 4-bit weights, float32 arithmetic

A candidate whose library is missing (onnxruntime is not a meshd dependency) or that this
CPU cannot run says so and is skipped.

    .venv/bin/python bench/kernels.py [--quick] [--json] [--reps N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import emit_json, machine_banner  # noqa: E402

BLOCK = 32
SHAPES = {"ffn_up 1536->8960": (1536, 8960), "ffn_down 8960->1536": (8960, 1536)}
ROWS = (1, 8, 512)


def quantized(k: int, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Codes [n, k] in 0..15 (value = (code - 8) * scale) and scales [n, k / 32], float32."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.02
    blocks = w.reshape(n, k // BLOCK, BLOCK)
    scales = np.abs(blocks).max(axis=2) / 7.0 + 1e-12
    codes = np.clip(np.rint(blocks / scales[..., None]) + 8, 0, 15).astype(np.uint8)
    return codes.reshape(n, k), scales.astype(np.float32)


def dequantized(codes: np.ndarray, scales: np.ndarray) -> torch.Tensor:
    n, k = codes.shape
    w = (codes.reshape(n, k // BLOCK, BLOCK).astype(np.float32) - 8) * scales[..., None]
    return torch.from_numpy(w.reshape(n, k))


def timed(fn, x, reps: int) -> float:
    fn(x)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# -- the candidates: each returns fn(x float32 [m, k]) -> float32 [m, n], or raises ----------------
def cand_float32(codes, scales):
    w = dequantized(codes, scales)
    return lambda x: F.linear(x, w)


def cand_torch_int4_bf16(codes, scales):
    n, k = codes.shape
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(codes.astype(np.int32)), 1)
    sz = torch.zeros(k // BLOCK, n, 2, dtype=torch.bfloat16)
    sz[..., 0] = torch.from_numpy(scales.T.copy()).to(torch.bfloat16)
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed, BLOCK, sz).float()


def cand_torch_bf16_dense(codes, scales):
    w = dequantized(codes, scales).to(torch.bfloat16)
    f = lambda x: F.linear(x.to(torch.bfloat16), w).float()  # noqa: E731
    f(torch.zeros(1, codes.shape[1]))  # oneDNN has no bfloat16 inner product without AVX-512: raises here
    return f


def cand_torch_dyn_quant(codes, scales):
    n, k = codes.shape
    lo, hi = codes[:, 0::2], codes[:, 1::2]
    packed_u8 = torch.from_numpy((lo | (hi << 4)).astype(np.uint8))
    sz = torch.from_numpy(scales.copy()).to(torch.bfloat16)
    w = torch.ops.aten._dyn_quant_pack_4bit_weight(packed_u8, sz, None, BLOCK, k, n)
    f = lambda x: torch.ops.aten._dyn_quant_matmul_4bit(x, w, BLOCK, k, n)  # noqa: E731
    f(torch.zeros(1, k))
    return f


def _ort(codes, scales, accuracy_level: int):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    n, k = codes.shape
    b = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8).reshape(n, k // BLOCK, BLOCK // 2)
    node = helper.make_node("MatMulNBits", ["A", "B", "scales"], ["Y"], domain="com.microsoft",
                            K=k, N=n, bits=4, block_size=BLOCK, accuracy_level=accuracy_level)
    graph = helper.make_graph(
        [node], "matmul", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])],
        initializer=[numpy_helper.from_array(b, "B"), numpy_helper.from_array(scales.reshape(-1), "scales")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return lambda x: torch.from_numpy(sess.run(None, {"A": x.numpy()})[0])


def cand_meshd_gguf(codes, scales):
    """meshd's own kernel (the gguf mode) on the same weights as Q4_0 blocks: a float16 scale, then
    16 bytes holding elements 0..15 in low nibbles and 16..31 in high ones."""
    from decoding.quant.blocks import BlockLinear, BlockPart

    n, k = codes.shape
    c = codes.reshape(n, k // BLOCK, BLOCK)
    qs = (c[:, :, :16] | (c[:, :, 16:] << 4)).astype(np.uint8)
    d = scales.astype(np.float16).view(np.uint8).reshape(n, k // BLOCK, 2)
    raw = np.ascontiguousarray(np.concatenate([d, qs], axis=2).reshape(n, -1))
    return BlockLinear([BlockPart("Q4_0", raw, k)])


CANDIDATES = {
    "float32": cand_float32,
    "meshd-gguf": cand_meshd_gguf,
    "torch-int4-bf16": cand_torch_int4_bf16,
    "torch-bf16-dense": cand_torch_bf16_dense,
    "torch-dyn-quant": cand_torch_dyn_quant,
    "ort-int8": lambda c, s: _ort(c, s, 4),
    "ort-fp32": lambda c, s: _ort(c, s, 1),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (about a minute)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--reps", type=int, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    reps = args.reps or (5 if args.quick else 20)
    setup = {**machine_banner(), "threads": 1, "block": BLOCK, "reps": reps, "rows": list(ROWS)}
    try:
        import onnxruntime

        setup["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        setup["onnxruntime"] = None
    print("# setup", setup, flush=True)
    results: dict = {}
    for shape_name, (k, n) in SHAPES.items():
        codes, scales = quantized(k, n)
        wbytes_q4 = n * k // 2 + n * k // BLOCK * 2  # what a Q4_0 matrix holds: 4 bits + an f16 scale per 32
        ref_w = dequantized(codes, scales)
        gen = torch.Generator().manual_seed(1)
        xs = {m: torch.randn(m, k, generator=gen) for m in ROWS}
        for name, build in CANDIDATES.items():
            try:
                fn = build(codes, scales)
            except Exception as exc:  # noqa: BLE001 - a candidate this machine cannot run
                results.setdefault(name, {})["unavailable"] = f"{type(exc).__name__}: {str(exc)[:160]}"
                print(f"{name:18s} unavailable: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                continue
            for m, x in xs.items():
                t = timed(fn, x, reps if m < 512 else max(2, reps // 4))
                y, want = fn(x), F.linear(x, ref_w)
                err = float((y - want).norm() / want.norm())
                alone = fn(x[:1])
                same = bool(torch.equal(alone[0], y[0]))
                row = {"us": round(t * 1e6, 1), "weight_gb_s": round(wbytes_q4 / t / 1e9, 2),
                       "gflop_s": round(2 * m * n * k / t / 1e9, 2), "rel_err_vs_f32": err,
                       "row_independent": same}
                results.setdefault(name, {}).setdefault(shape_name, {})[str(m)] = row
                print(f"{name:18s} {shape_name:20s} M={m:4d} {row['us']:10.1f} us  {row['weight_gb_s']:6.2f} GB/s(q4)"
                      f"  {row['gflop_s']:7.2f} GFLOP/s  err {err:.2e}  row-independent {same}", flush=True)
    emit_json({"setup": setup, "candidates": results}) if args.json else None
    return 0


if __name__ == "__main__":
    sys.exit(main())
