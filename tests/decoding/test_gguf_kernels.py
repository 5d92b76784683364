"""The integer kernels on GGUF blocks: llama.cpp's arithmetic, one row's bits whatever comes with it."""

import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

from decoding.quant import native
from decoding.quant.blocks import BlockLinear, BlockPart

OK, WHY = native.available()
pytestmark = pytest.mark.skipif(not OK, reason=f"integer kernels unavailable: {WHY}")

TYPES = tuple(native.TYPE_IDS)


def cols_for(type_name: str, k_quant_cols: int, blocks_over: int) -> int:
    """Columns for a test matrix: the 32-element types get ``blocks_over`` blocks past a multiple of four,
    since their kernels take blocks four at a time and a row's last one to three blocks take their own path."""
    if gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][0] == 256:
        return k_quant_cols
    return k_quant_cols + 32 * blocks_over


def random_blocks(type_name: str, rows: int, cols: int, seed: int = 0, scale: float = 0.02) -> np.ndarray:
    """Valid blocks of any type: random codes and scale bytes, finite float16 scales (and minimums)."""
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[type_name]
    elems, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // elems * size), dtype=np.uint8)
    view = raw.reshape(rows, cols // elems, size)
    halves = lambda: rng.uniform(-scale, scale, (rows, cols // elems)).astype(np.float16)  # noqa: E731
    at = 208 if type_name == "Q6_K" else 0
    view[:, :, at:at + 2] = halves().view(np.uint8).reshape(rows, -1, 2)
    if type_name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"):
        view[:, :, 2:4] = halves().view(np.uint8).reshape(rows, -1, 2)
    return raw


def widened(type_name: str, raw: np.ndarray, cols: int) -> np.ndarray:
    """gguf-py's own dequantisation (the reference for what the blocks mean), in float64."""
    w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
    return np.asarray(w, dtype=np.float64).reshape(raw.shape[0], cols)


def quantized_activations(x: np.ndarray, block: int) -> tuple[native.QuantizedRows, np.ndarray]:
    q = native.quantize_rows(x, block)
    values = q.q.reshape(x.shape[0], -1, block).astype(np.float64) * q.d[:, :, None].astype(np.float64)
    return q, values.reshape(x.shape)


@pytest.mark.parametrize("type_name", TYPES)
def test_each_block_type_computes_its_widened_weights_times_the_quantised_activations(type_name):
    rows, cols = 48, cols_for(type_name, 768, 1)
    raw = random_blocks(type_name, rows, cols)
    x = np.random.default_rng(1).standard_normal((5, cols)).astype(np.float32)
    xq, x_used = quantized_activations(x, native.ACT_BLOCK[type_name])
    out = np.zeros((5, rows), np.float32)
    native.matmul_into(out, xq, type_name, raw, cols)
    want = x_used @ widened(type_name, raw, cols).T
    # the integer part is exact; what is left is float32 accumulation over ~800 products
    assert np.abs(out - want).max() <= 1e-5 * np.abs(want).max()
    # and the activations' int8 rounding keeps the product near the float one (llama.cpp's own error)
    full = x.astype(np.float64) @ widened(type_name, raw, cols).T
    assert np.abs(want - full).max() <= 0.02 * np.abs(full).max()


@pytest.mark.parametrize("type_name", TYPES)
def test_edge_codes_and_extreme_activations_stay_exact(type_name):
    """Every code at its largest (and the int8 extremes) against activations at +-amax: the integer
    sums are where a saturating instruction would show."""
    rows, cols = 8, 512
    raw = random_blocks(type_name, rows, cols, seed=3)
    elems, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    view = raw.reshape(rows, cols // elems, size)
    keep = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 2, "Q5_1": 4, "Q8_0": 2, "Q4_K": 16, "Q5_K": 16, "Q6_K": 0}[type_name]
    end = size - 2 if type_name == "Q6_K" else size
    view[0, :, keep:end] = 0xFF
    view[1, :, keep:end] = 0x00
    view[2, :, keep:end] = 0x80
    if type_name == "Q6_K":
        view[:, :, 192:208] = np.array([127, 0x80] * 8, np.uint8)  # scales +127 and -128
    x = np.where(np.arange(cols) % 3 == 0, 1.0, -1.0).astype(np.float32)[None].repeat(3, 0)
    x[1] *= 1e-3
    x[2] = np.linspace(-4, 4, cols, dtype=np.float32)
    xq, x_used = quantized_activations(x, native.ACT_BLOCK[type_name])
    out = np.zeros((3, rows), np.float32)
    native.matmul_into(out, xq, type_name, raw, cols)
    want = x_used @ widened(type_name, raw, cols).T
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("type_name", TYPES)
def test_a_row_gets_the_same_bits_whatever_rows_come_with_it(type_name):
    rows, cols = 40, cols_for(type_name, 512, 3)
    raw = random_blocks(type_name, rows, cols, seed=4)
    x = np.random.default_rng(5).standard_normal((70, cols)).astype(np.float32)
    block = native.ACT_BLOCK[type_name]
    together = np.zeros((70, rows), np.float32)
    native.matmul_into(together, native.quantize_rows(x, block), type_name, raw, cols)
    # the first tile's groups of eight (rows 0-63), the second's groups of four (64-67, then 68-69 and copies)
    alone = np.zeros((70, rows), np.float32)
    for i in range(70):
        native.matmul_into(alone[i:i + 1], native.quantize_rows(x[i:i + 1], block), type_name, raw, cols)
    assert np.array_equal(alone, together)
    for m in (2, 3, 5, 6, 7, 9, 11):  # a verify round's few rows: a group of four filled up with copies
        few = np.zeros((m, rows), np.float32)
        native.matmul_into(few, native.quantize_rows(x[:m], block), type_name, raw, cols)
        assert np.array_equal(few, alone[:m]), m
    # and split over weight rows (threads), each half computes the same bits
    halves = np.zeros_like(together)
    xq = native.quantize_rows(x, block)
    native.matmul_into(halves, xq, type_name, raw, cols, rows=(0, 17))
    native.matmul_into(halves, xq, type_name, raw, cols, rows=(17, rows))
    assert np.array_equal(halves, together)


def test_the_avx2_and_portable_builds_give_the_same_bits():
    """A mesh of an AVX2 mini PC and an ARM board computes one answer: the two builds agree exactly."""
    if native.variant()[0] != "avx2":
        pytest.skip("this CPU runs the portable build only")
    code = (
        "import numpy as np, sys; sys.path.insert(0, '.');"
        "from tests.decoding.test_gguf_kernels import random_blocks;"
        "from decoding.quant import native;"
        "from decoding.quant.row_ops import rms_norm, rope_, swiglu; import torch;"
        "x = np.random.default_rng(7).standard_normal((13, 512)).astype(np.float32);"
        "parts = [];"
        # 1 and 3 rows take the decode path (blocks decoded as read), 6 and 13 the pre-decoded one (groups of
        # eight and four rows); 512 columns are whole groups of four blocks, 480, 448, 416 leave three, two, one
        "[parts.append((native.matmul_into(o := np.zeros((m, 24), np.float32), native.quantize_rows(x[:m, :k], native.ACT_BLOCK[t]),"
        " t, random_blocks(t, 24, k, seed=8), k), o.tobytes().hex())[1]) for t in native.TYPE_IDS for m in (1, 3, 6, 13)"
        " for k in ((512,) if native.ACT_BLOCK[t] == 256 else (512, 480, 448, 416))];"
        # quantising: NaN, infinities, subnormals, ties and blocks too small to scale
        "xe = x.copy(); xe[0, :8] = [np.nan, np.inf, -np.inf, 1e-40, 0.5, -0.5, 2.5, 0.0]; xe[1, :256] = 1e-42;"
        "xe[2] = np.round(xe[2] * 4) / 4; xe[3, 32:64] = np.linspace(-127, 127, 32);"
        "[parts.append(''.join(a.tobytes().hex() for a in (r.q, r.d, r.s))) for r in"
        " (native.quantize_rows(xe, 32), native.quantize_rows(xe, 256))];"
        "xt = torch.from_numpy(x[:6].copy()); q = xt.view(6, 8, 64).clone();"
        "parts.append(rms_norm(xt, torch.ones(512), 1e-6).numpy().tobytes().hex());"
        "parts.append(rope_(q, xt[:, :64], xt[:, 64:128]).numpy().tobytes().hex());"
        "g = torch.cat([xt * 30, xt[:, :20]], 1); parts.append(swiglu(g).numpy().tobytes().hex());"
        "print(native.isa(), '|'.join(parts))"
    )
    outs = {}
    for isa in ("avx2", "portable"):
        env = dict(os.environ, MESHD_KERNEL_ISA=isa)
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                              cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
        assert done.returncode == 0, done.stderr[-2000:]
        name, bits = done.stdout.split()
        outs[name] = bits
    assert set(outs) == {"avx2", "portable"} and outs["avx2"] == outs["portable"]


def test_a_block_weight_joins_matrices_of_different_types_and_puts_permuted_rows_back():
    cols = 512
    q = BlockPart("Q4_K", random_blocks("Q4_K", 32, cols, seed=9), cols, np.random.default_rng(0).permutation(32))
    v = BlockPart("Q6_K", random_blocks("Q6_K", 16, cols, seed=10), cols)
    w = BlockLinear([q, v])
    assert w.shape == (48, cols) and w.nbytes == q.blocks.nbytes + v.blocks.nbytes
    x = torch.randn(3, cols)
    want = x.double() @ w.dequantize().double().T
    got = w(x, bias=torch.ones(48))
    torch.testing.assert_close(got.double() - 1, want, rtol=0, atol=0.03 * float(want.abs().max()))
    assert torch.equal(w.parts[0].dequantize()[:, :8], w.dequantize()[:32, :8])  # output order


def test_a_block_weight_splits_a_product_over_threads_without_changing_a_bit():
    cols = 1024
    w = BlockLinear([BlockPart("Q4_K", random_blocks("Q4_K", 256, cols, seed=11), cols)])
    x = torch.randn(70, cols)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = w(x)
        torch.set_num_threads(2)
        two = w(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_lookups_widen_only_the_rows_asked_for_in_output_order():
    cols = 256
    perm = np.random.default_rng(2).permutation(16)
    w = BlockLinear([BlockPart("Q8_0", random_blocks("Q8_0", 16, cols, seed=12), cols, perm)])
    ids = torch.tensor([3, 0, 15, 3])
    assert torch.equal(w.lookup(ids), w.dequantize()[ids])


def test_only_float32_activations_are_multiplied():
    w = BlockLinear([BlockPart("Q8_0", random_blocks("Q8_0", 8, 64), 64)])
    with pytest.raises(TypeError, match="float32"):
        w(torch.zeros(1, 64, dtype=torch.bfloat16))


def test_types_the_kernels_do_not_take_are_refused_by_name():
    with pytest.raises(ValueError, match="Q3_K"):
        BlockLinear([BlockPart("Q3_K", np.zeros((1, 110), np.uint8), 256)])
