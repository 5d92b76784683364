"""The packed numeric mode: a model's 4-bit weights are multiplied as they are, and say so."""

import gguf
import numpy as np
import pytest
import torch

from decoding.quant.groups import (EIGHT_BIT_TYPES, FOUR_BIT_TYPES, Int4Groups, from_gguf_blocks,
                                   from_gguf_eight_bit, requantize, requantize_8bit)
from decoding.quant.packed import DENSE_FROM_ROWS, INT4_OK, ConcatLinear, PackedLinear
from tests.support.parity import disagreements_at_clear_choices, logits_after_cuts, steps_and_round

pytestmark = pytest.mark.skipif(not INT4_OK, reason="this torch has no CPU int4 kernel")


def gguf_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Raw GGUF blocks of a [rows, cols] tensor: quantised by gguf where it can, else random valid bytes."""
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name != "Q4_K":
        return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, qtype)
    blocks = rng.integers(0, 256, size=(rows * cols // 256, 144), dtype=np.uint8)
    d = (rng.random((blocks.shape[0], 2)) * 0.01).astype(np.float16)  # finite d and dmin
    blocks[:, 0:4] = d.view(np.uint8).reshape(-1, 4)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("type_name", FOUR_BIT_TYPES)
def test_a_four_bit_tensor_keeps_its_own_codes(type_name):
    rows, cols = 64, 512
    blocks = gguf_blocks(type_name, rows, cols)
    want = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[type_name]).reshape(rows, cols)
    groups = from_gguf_blocks(type_name, blocks, (rows, cols))
    got = groups.dequantize().numpy()
    # the same weights up to float32 rounding of (q - 8) * scale + offset against the file's formula
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    assert groups.codes.max() <= 15


@pytest.mark.parametrize("type_name", FOUR_BIT_TYPES)
def test_packing_changes_only_the_scale_and_offset_format(type_name):
    """Packed, a weight is its code times a bfloat16 scale plus a bfloat16 offset, computed exactly."""
    rows, cols = 128, 256
    groups = from_gguf_blocks(type_name, gguf_blocks(type_name, rows, cols, seed=1), (rows, cols))
    rounded = Int4Groups(groups.codes, groups.scale.bfloat16().float(), groups.offset.bfloat16().float())
    assert torch.equal(PackedLinear(groups).dequantize(), rounded.dequantize().bfloat16())
    rel = (rounded.dequantize() - groups.dequantize()).abs().max() / groups.dequantize().abs().max()
    assert rel < 2 ** -7  # the whole distance from the file's weights: bfloat16 scales and offsets


@pytest.mark.parametrize("type_name", EIGHT_BIT_TYPES)
def test_an_eight_bit_tensor_keeps_its_own_codes_in_two_planes(type_name):
    rows, cols = 64, 256
    blocks = gguf_blocks(type_name, rows, cols, seed=2)
    want = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[type_name]).reshape(rows, cols)
    hi, lo = from_gguf_eight_bit(type_name, blocks, (rows, cols))
    np.testing.assert_allclose((hi.dequantize() + lo.dequantize()).numpy(), want, rtol=1e-6, atol=1e-7)
    # packed, each weight is exactly its code times the file's scale rounded to bfloat16
    d = torch.from_numpy(blocks.reshape(-1, blocks.shape[1] // (cols // 32))[:, :2].copy().view(np.float16)
                         .astype(np.float32)).reshape(rows, cols // 32)
    codes = torch.from_numpy(want).reshape(rows, cols // 32, 32) / d.unsqueeze(-1)
    exact = (codes.round() * d.bfloat16().float().unsqueeze(-1)).reshape(rows, cols)
    assert torch.equal(PackedLinear([hi, lo]).dequantize().float(), exact.bfloat16().float())


def test_wider_tensors_round_to_eight_bits_within_half_a_step():
    w = torch.randn(64, 256)
    hi, lo = requantize_8bit(w)
    step = lo.scale.repeat_interleave(32, dim=1)
    assert ((hi.dequantize() + lo.dequantize() - w).abs() <= step * 0.51 + 1e-6).all()


def test_a_two_plane_product_is_the_sum_of_its_planes():
    w = torch.randn(128, 256) * 0.05
    layer = PackedLinear(list(requantize_8bit(w)))
    x = torch.randn(3, 256).bfloat16()
    assert layer.bits == 8
    torch.testing.assert_close(layer(x).float(), x.float() @ layer.dequantize().float().T, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(layer.dequantize().float(), w, rtol=0, atol=float(w.abs().max()) / 100)


def test_matrices_of_different_widths_multiply_side_by_side():
    four, eight = PackedLinear(requantize(torch.randn(64, 128))), PackedLinear(list(requantize_8bit(torch.randn(64, 128))))
    both = ConcatLinear([four, eight])
    x = torch.randn(2, 128).bfloat16()
    assert both.shape == (128, 128)
    assert torch.equal(both(x), torch.cat([four(x), eight(x)], dim=-1))


def test_rows_that_are_not_a_multiple_of_the_kernel_tile_are_padded_and_trimmed():
    groups = requantize(torch.randn(80, 96))
    layer = PackedLinear(groups)
    x = torch.randn(3, 96).bfloat16()
    assert layer(x).shape == (3, 80)
    assert torch.equal(layer.dequantize(), groups.dequantize().bfloat16())


def test_requantising_stays_within_half_a_step_of_each_weight():
    w = torch.randn(64, 256)
    groups = requantize(w)
    step = groups.scale.repeat_interleave(32, dim=1)
    assert ((groups.dequantize() - w).abs() <= step * 0.5 + 1e-6).all()


def test_the_kernel_computes_the_widened_weights_product():
    groups = requantize(torch.randn(256, 512) * 0.05)
    layer = PackedLinear(groups)
    x = torch.randn(4, 512).bfloat16()
    want = x.float() @ layer.dequantize().float().T
    torch.testing.assert_close(layer(x).float(), want, rtol=2e-2, atol=2e-2)


def test_a_row_gets_the_same_bits_whatever_rows_come_with_it():
    """Decode steps, verify rounds and batches all stay below DENSE_FROM_ROWS: one row's result is
    the same alone or among others."""
    layer = PackedLinear(requantize(torch.randn(192, 256)))
    x = torch.randn(DENSE_FROM_ROWS - 1, 256).bfloat16()
    alone = torch.cat([layer(x[i:i + 1]) for i in range(x.shape[0])])
    assert torch.equal(layer(x), alone)
    assert torch.equal(layer(x[:5]), alone[:5])


def test_long_prompts_widen_into_one_bounded_scratch_buffer():
    layer = PackedLinear(requantize(torch.randn(128, 256)))
    x = torch.randn(DENSE_FROM_ROWS + 8, 256).bfloat16()
    y = layer(x)
    torch.testing.assert_close(y.float(), x.float() @ layer.dequantize().float().T, rtol=2e-2, atol=5e-2)
    assert layer.scratch.nbytes == 128 * 256 * 2
    layer(x)
    assert layer.scratch.nbytes == 128 * 256 * 2  # re-used, not grown


def test_only_bfloat16_activations_are_multiplied():
    layer = PackedLinear(requantize(torch.randn(64, 64)))
    with pytest.raises(TypeError, match="bfloat16"):
        layer(torch.randn(1, 64))


# -- the embedded model, packed -------------------------------------------------------------------

@pytest.fixture(scope="module")
def packed_stage(real_source):
    return real_source.load_stage(0, real_source.config.num_layers, torch.bfloat16, packed=True)


def test_the_embedded_model_packed_holds_its_file_bytes_not_eight_times_them(real_source, packed_stage):
    file_bytes = real_source.path.stat().st_size
    assert packed_stage.packed
    assert packed_stage.weight_bytes() <= 1.25 * file_bytes
    kinds = set(packed_stage.formats.values())
    # every layer matrix of the Q4_1 file keeps its codes, and so does the Q8_0 embedding-as-head
    assert kinds == {"int4 (Q4_1, its own codes)", "int8 (Q8_0, its own codes)",
                     "the LM head's rows, widened per lookup"}


def test_a_tied_head_serves_lookups_with_the_embeddings_rows(real_source, packed_stage):
    ids = torch.tensor([0, 5, 64, 63, 49151, 5])
    want = real_source.read_tensor("embed")[ids]
    got = packed_stage.embed.lookup(ids).float()
    torch.testing.assert_close(got, want, rtol=2 ** -7, atol=float(want.abs().max()) * 2 ** -8)
    assert packed_stage.embed is packed_stage.lm_head


def test_a_packed_stage_gives_each_token_the_same_logits_alone_or_in_a_verify_round(real_source, packed_stage):
    """Row-count independence of the whole forward: a speculative round of 6 tokens computes what 6
    decode steps would, bit for bit."""
    tok = real_source.tokenizer
    prompt = torch.tensor(tok.encode("The three primary colours are"))
    more = torch.tensor(tok.encode(" red, yellow and blue, and"))[:6]
    steps, together = steps_and_round(packed_stage, prompt, more)
    assert torch.equal(steps, together)


def test_a_prompt_cut_at_block_boundaries_is_computed_as_one_device_computes_it_uncut(real_source, packed_stage):
    """Pipelined prefill cuts a prompt where the planner says (aligned to EXACT_BLOCK in a packed home):
    every cut, and the decode steps after it, give the uncut prompt's logits bit for bit."""
    from decoding.batch import EXACT_BLOCK

    tok = real_source.tokenizer
    ids = torch.tensor(tok.encode("A home is a collection of small systems that were never designed together. " * 12))
    assert len(ids) > 2 * EXACT_BLOCK + 10

    run = lambda cuts: logits_after_cuts(packed_stage, ids, cuts, 4)  # noqa: E731

    whole = run([])
    assert torch.equal(run([EXACT_BLOCK]), whole)
    assert torch.equal(run([EXACT_BLOCK, 2 * EXACT_BLOCK]), whole)


@pytest.mark.parametrize("packing", ["packed", "packed4"])
def test_two_packed_stages_give_one_devices_tokens(real_source, packing):
    """The mesh's split in-process: the first stage embeds with the same matrix the last multiplies by
    (the embedded model ties them), and a prompt cut at a block boundary changes nothing."""
    from decoding.generate import generate
    from decoding.pipeline_local import LocalPipeline
    from decoding.batch import EXACT_BLOCK

    tok = real_source.tokenizer
    one = LocalPipeline.from_source(real_source, 1, torch.bfloat16, packed=packing)
    two = LocalPipeline.from_source(real_source, 2, torch.bfloat16, packed=packing)
    ids = tok.encode("A home is a collection of small systems that were never designed together. " * 8)
    want = generate(one, ids, 12).token_ids
    assert generate(two, ids, 12).token_ids == want
    assert generate(two, ids, 12, cuts=[EXACT_BLOCK]).token_ids == want
    assert torch.equal(two.stages[0].embed.lookup(torch.tensor([5, 900])),
                       one.stages[0].embed.lookup(torch.tensor([5, 900])))


def test_packed_and_float32_pick_the_same_token_wherever_float32_is_not_a_near_tie(real_source, packed_stage, real_stage):
    """Teacher-forced over float32's own answer: wherever float32's top two tokens are clearly apart,
    the packed stage picks float32's token. (Near-ties may flip by rounding — on an AVX2 CPU "The"
    vs "L" for this question is 0.152 vs 0.140 — which greedy agreement over whole answers, in
    bench/peers.py, measures; a layout read back wrong flips every token.)"""
    wrong, clear, n = disagreements_at_clear_choices(real_source, real_stage, packed_stage)
    assert clear >= n // 2, "the answer has enough clear choices to compare"
    assert not wrong, f"packed disagrees at clear positions {wrong}"


def test_the_kernels_row_layout_is_read_back_on_this_cpu():
    """Embedding lookups and prefill widen the packed codes: the layout the int4 kernel packs in
    (64-row blocks on AVX-512, 32-row on AVX2) must be the one meshd reads back, or the packed
    mode is not offered at all."""
    from decoding.quant import packed as packed_mod

    if not packed_mod.INT4_OK:
        pytest.skip(packed_mod.INT4_UNAVAILABLE)
    codes = torch.randint(0, 16, (192, 96), dtype=torch.int32)
    assert torch.equal(packed_mod._unpack_cpu(packed_mod._pack_cpu(codes), 192, 96).int(), codes)
