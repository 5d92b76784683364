"""The gguf numeric mode: a model multiplied on its file's own blocks, mapped, exact within the mode."""

import resource

import pytest
import torch

from decoding.quant import native, row_ops
from decoding.quant.blocks import BlockLinear
from tests.support.parity import disagreements_at_clear_choices, logits_after_cuts, steps_and_round

OK, WHY = native.available()
pytestmark = pytest.mark.skipif(not OK, reason=f"integer kernels unavailable: {WHY}")


@pytest.fixture(scope="module")
def gguf_stage(real_source):
    return real_source.load_stage(0, real_source.config.num_layers, torch.float32, packed="gguf")


def test_every_matrix_is_a_view_of_the_mapped_file(real_source, gguf_stage):
    assert gguf_stage.packing == "gguf" and gguf_stage.dtype == torch.float32
    kinds = set(gguf_stage.formats.values())
    # the embedded Q4_1 file: Q4_1 layers, and the Q8_0 embedding that is also the head
    assert kinds == {"Q4_1 blocks, mapped", "Q8_0 blocks, mapped", "Q8_0 blocks, mapped, rows widened per lookup"}
    w = gguf_stage.layers[0].gate_up
    assert isinstance(w, BlockLinear)
    base = w.parts[0].blocks
    while base.base is not None and not hasattr(base, "filename"):
        base = base.base
    assert hasattr(base, "filename") or type(base).__name__ == "mmap", "weights are the file's mapped pages"
    assert gguf_stage.weight_bytes() <= 1.02 * real_source.path.stat().st_size


def test_loading_reads_no_weights_into_the_heap(real_source):
    """Ready in the time it takes to map the file: the heap grows by norms and biases only."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    stage = real_source.load_stage(0, real_source.config.num_layers, torch.float32, packed="gguf")
    grown_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert stage.weight_bytes() > 50e6 and grown_kb * 1024 < 0.1 * stage.weight_bytes()


def test_a_tied_head_serves_lookups_with_the_embeddings_rows(real_source, gguf_stage):
    ids = torch.tensor([0, 5, 64, 63, 49151, 5])
    assert torch.equal(gguf_stage.embed.lookup(ids), real_source.read_tensor("embed")[ids])
    assert gguf_stage.embed is gguf_stage.lm_head


def test_each_token_gets_the_same_logits_alone_or_in_a_verify_round(real_source, gguf_stage):
    tok = real_source.tokenizer
    prompt = torch.tensor(tok.encode("The three primary colours are"))
    more = torch.tensor(tok.encode(" red, yellow and blue, and"))[:6]
    steps, together = steps_and_round(gguf_stage, prompt, more)
    assert torch.equal(steps, together)


def test_a_prompt_cut_at_block_boundaries_is_computed_as_uncut(real_source, gguf_stage):
    from decoding.batch import EXACT_BLOCK

    ids = torch.tensor(real_source.tokenizer.encode("A home is a collection of small systems. " * 20))
    assert len(ids) > 2 * EXACT_BLOCK + 10

    run = lambda cuts: logits_after_cuts(gguf_stage, ids, cuts, 3)  # noqa: E731

    whole = run([])
    assert torch.equal(run([EXACT_BLOCK]), whole)
    assert torch.equal(run([EXACT_BLOCK, 2 * EXACT_BLOCK]), whole)


def test_two_gguf_stages_give_one_devices_tokens(real_source):
    from decoding.batch import EXACT_BLOCK
    from decoding.generate import generate
    from decoding.pipeline_local import LocalPipeline

    one = LocalPipeline.from_source(real_source, 1, torch.float32, packed="gguf")
    two = LocalPipeline.from_source(real_source, 2, torch.float32, packed="gguf")
    ids = real_source.tokenizer.encode("A home is a collection of small systems that were never designed together. " * 8)
    want = generate(one, ids, 12).token_ids
    assert generate(two, ids, 12).token_ids == want
    assert generate(two, ids, 12, cuts=[EXACT_BLOCK]).token_ids == want


def test_gguf_and_float32_pick_the_same_token_wherever_float32_is_not_a_near_tie(real_source, gguf_stage, real_stage):
    """int8 activations move the logits a little (llama.cpp's own arithmetic); clear choices stay."""
    wrong, clear, n = disagreements_at_clear_choices(real_source, real_stage, gguf_stage)
    assert clear >= n // 2 and not wrong, f"gguf disagrees at clear positions {wrong}"


def test_the_row_steps_match_torchs_and_each_row_is_its_own(real_source):
    from decoding.models.llama.layers import rms_norm, rotate

    x, w = torch.randn(7, 576), torch.randn(576)
    torch.testing.assert_close(row_ops.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-5)
    assert torch.equal(row_ops.rms_norm(x[3:4], w, 1e-5)[0], row_ops.rms_norm(x, w, 1e-5)[3])
    q, cos, sin = torch.randn(7, 9, 64), torch.randn(7, 64), torch.randn(7, 64)
    want = rotate(q.transpose(0, 1), cos, sin)
    assert torch.equal(row_ops.rope_(q.clone(), cos, sin).transpose(0, 1), want)
    wide = torch.randn(7, 3 * 9 * 64)  # q inside a fused q/k/v row: rotated in place, the rest untouched
    view = wide[:, :9 * 64].view(7, 9, 64)
    expect = rotate(view.transpose(0, 1).clone(), cos, sin)
    rest = wide[:, 9 * 64:].clone()
    row_ops.rope_(view, cos, sin)
    assert torch.equal(view.transpose(0, 1), expect) and torch.equal(wide[:, 9 * 64:], rest)


def test_swiglu_is_within_a_few_ulp_of_exact_everywhere_and_each_row_is_its_own():
    g = torch.cat([torch.randn(6, 1540) * 6, torch.linspace(-120, 120, 1540).view(1, -1)])
    g[0, :6] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.5, -88.5])
    gate_up = torch.cat([g, torch.randn(7, 1540)], 1)  # 1540: not a multiple of the kernel's eight lanes
    got = row_ops.swiglu(gate_up).double()
    gd, ud = gate_up.double().chunk(2, dim=-1)
    exact = gd * torch.sigmoid(gd) * ud
    assert ((got - exact).abs() <= 2e-6 * exact.abs() + 1e-36).all()  # float32's own: ~1.2e-7 an op
    alone = torch.cat([row_ops.swiglu(gate_up[i:i + 1]) for i in range(7)])
    assert torch.equal(alone, row_ops.swiglu(gate_up))
    strided = torch.zeros(7, 4000)[:, :3080]
    strided.copy_(gate_up)
    assert torch.equal(row_ops.swiglu(strided), row_ops.swiglu(gate_up))


@pytest.mark.parametrize("kind", ["llama3", "qwen3"])
def test_a_quantised_file_computes_what_transformers_computes_on_its_stored_weights(tmp_path, kind):
    """Llama files store q/k rows permuted (put back through the output columns); Qwen3 normalises
    q/k per head: the mode's logits are transformers' on the file's values, up to int8 activations."""
    from decoding.loader import open_model
    from tests.support.gguf_convert import as_stored, write_gguf
    from tests.support.tiny_archs import build_model

    model = build_model(kind)
    source = open_model(write_gguf(model, tmp_path / f"{kind}.gguf", "Q4_0"))
    stage = source.load_stage(0, source.config.num_layers, torch.float32, packed="gguf")
    assert "Q4_0 blocks, mapped" in stage.formats.values()
    ids = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(1))
    kv = stage.new_cache(64)
    kv.create("s", 40)
    got = stage.forward(kv, "s", ids)
    with torch.no_grad():
        want = as_stored(model, "Q4_0")(ids[None]).logits[0].float()
    assert float((got - want).abs().max()) <= 0.05 * float(want.abs().max())
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.9


def test_types_the_kernels_do_not_take_are_rounded_to_q8_0_and_stay_exact(tmp_path):
    from decoding.loader import open_model
    from tests.support.gguf_convert import write_gguf
    from tests.support.tiny_archs import build_model

    model = build_model("llama3")
    source = open_model(write_gguf(model, tmp_path / "f16.gguf", "F16"))
    stage = source.load_stage(0, source.config.num_layers, torch.float32, packed="gguf")
    kinds = set(stage.formats.values())
    assert "Q8_0, rounded from F16" in kinds and "F16 rows, widened per lookup" in kinds
    steps, together = steps_and_round(stage, torch.arange(5, 25), torch.arange(40, 46))
    assert torch.equal(steps, together)


def test_a_stage_computes_the_same_bits_with_one_thread_or_two(real_source, gguf_stage):
    """A daemon and the reference it is held to may run different thread counts: a prompt (a whole
    position block and the rows after it) and decode steps give the same logits either way."""
    ids = torch.tensor(real_source.tokenizer.encode("Once upon a time there was a sailor who loved the sea. " * 5))
    before = torch.get_num_threads()

    def run(threads: int) -> list[torch.Tensor]:
        torch.set_num_threads(threads)
        kv = gguf_stage.new_cache(512)
        kv.create("s", 64)
        outs = [gguf_stage.forward(kv, "s", ids, all_logits=False)]
        for _ in range(4):
            outs.append(gguf_stage.forward(kv, "s", outs[-1][-1].argmax().view(1), all_logits=False))
        return outs

    try:
        one, two = run(1), run(2)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
