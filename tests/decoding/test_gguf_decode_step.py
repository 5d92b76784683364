"""The gguf mode's decode step in two kernel calls a layer gives the per-operation path's bits."""

import pytest
import torch

from decoding.quant import native

OK, WHY = native.available()
pytestmark = pytest.mark.skipif(not OK, reason=f"integer kernels unavailable: {WHY}")


def gguf_stage(source, fast: bool):
    stage = source.load_stage(0, source.config.num_layers, torch.float32, packed="gguf")
    if not fast:
        stage._decode_steps = False  # the per-operation path for every row (the reference here)
    return stage


def decode(stage, prompt: torch.Tensor, steps: int, threads: int = 1, fork_at: int = 0) -> torch.Tensor:
    """Logits of the prompt's last row and of ``steps`` greedy decode steps. ``fork_at`` > 0: the
    sequence reads its first ``fork_at`` positions from a parent in place, as a cached prefix is read."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kv = stage.new_cache(1024)
        if fork_at:
            kv.create("parent", 128)
            stage.forward(kv, "parent", prompt[:fork_at], all_logits=False)
            kv.fork("parent", "s", fork_at)
            out = [stage.forward(kv, "s", prompt[fork_at:], all_logits=False)[-1]]
        else:
            kv.create("s", 64)
            out = [stage.forward(kv, "s", prompt, all_logits=False)[-1]]
        for _ in range(steps):
            out.append(stage.forward(kv, "s", out[-1].argmax().view(1), all_logits=False)[-1])
        return torch.stack(out)
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def smol(real_source):
    return real_source, gguf_stage(real_source, True), gguf_stage(real_source, False)


def test_the_two_call_step_serves_the_embedded_model(smol):
    _, fast, _ = smol
    assert fast.decode_steps is not None


def test_decode_steps_in_two_calls_a_layer_equal_the_per_operation_path(smol):
    source, fast, slow = smol
    prompt = torch.tensor(source.tokenizer.encode("The lighthouse keeper climbed the stairs at dusk, and"))
    want = decode(slow, prompt, 24)
    assert torch.equal(decode(fast, prompt, 24), want)
    assert torch.equal(decode(fast, prompt, 24, threads=2), want)  # heads and rows split over two threads


def test_a_forked_sequence_reads_its_prefix_in_place_with_the_same_bits(smol):
    """A request reusing a cached prompt decodes over two segments; the step reads both where they lie
    and gives the bits of the same positions held in one buffer."""
    source, fast, slow = smol
    prompt = torch.tensor(source.tokenizer.encode("A home is a collection of small systems. " * 12))
    assert len(prompt) > 80
    want = decode(slow, prompt, 8)
    assert torch.equal(decode(fast, prompt, 8, fork_at=64), want)
    assert torch.equal(decode(slow, prompt, 8, fork_at=64), want)


def decode_together(stage, prompts: list[torch.Tensor], steps: int, threads: int = 1, fork_first_at: int = 0):
    """Every prompt's sequence prefilled alone, then ``steps`` greedy steps of all of them in one pass a step
    (requests decoding together); the first one reads its first ``fork_first_at`` positions from a parent.
    Returns each sequence's logits as :func:`decode` does."""
    from decoding.batch import BatchItem

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kv = stage.new_cache(4096)
        outs = []
        for i, prompt in enumerate(prompts):
            if i == 0 and fork_first_at:
                kv.create("parent", 256)
                stage.forward(kv, "parent", prompt[:fork_first_at], all_logits=False)
                kv.fork("parent", "s0", fork_first_at)
                outs.append([stage.forward(kv, "s0", prompt[fork_first_at:], all_logits=False)[-1]])
            else:
                kv.create(f"s{i}", 64)
                outs.append([stage.forward(kv, f"s{i}", prompt, all_logits=False)[-1]])
        for _ in range(steps):
            items = [BatchItem(f"s{i}", o[-1].argmax().view(1), all_logits=False) for i, o in enumerate(outs)]
            for o, got in zip(outs, stage.forward_batch(kv, items)):
                o.append(got[-1])
        return [torch.stack(o) for o in outs]
    finally:
        torch.set_num_threads(before)


def test_sequences_decoding_together_take_one_call_and_each_gets_its_bits_alone(smol):
    """Requests decoding together (two people at once, a replica's batch): one kernel call a step for every
    row, their products taken at once, each row's cache its own (one of them a forked prefix) — and each
    sequence's logits equal to its decoding alone, on either path, at any thread count."""
    source, fast, slow = smol
    texts = ["A home is a collection of small systems. " * 10, "Turn on the kitchen light", "Why is the sky blue?"]
    prompts = [torch.tensor(source.tokenizer.encode(t)) for t in texts]
    alone = [decode(slow, p, 10) for p in prompts]
    calls = []
    real = fast.decode_steps.run
    fast.decode_steps.run = lambda kv, items, *a: calls.append(len(items)) or real(kv, items, *a)
    try:
        together = decode_together(fast, prompts, 10, fork_first_at=64)
    finally:
        fast.decode_steps.run = real
    assert calls.count(3) == 10  # every step of the three sequences in one call
    for got, want in zip(together, alone):
        assert torch.equal(got, want)
    for got, want in zip(decode_together(slow, prompts, 10, threads=2), alone):
        assert torch.equal(got, want)
    for got, want in zip(decode_together(fast, prompts, 10, threads=2), alone):
        assert torch.equal(got, want)


def test_a_verify_rounds_chain_and_a_short_prompt_take_the_step_with_the_per_operation_bits(smol):
    """A chain of drafted rows (a verify round) and a prompt shorter than a position block: each row
    attends alone over the keys up to itself, so the step computes them all in one call, and a whole
    position block still takes the per-operation path."""
    source, fast, slow = smol
    prompt = torch.tensor(source.tokenizer.encode("The lighthouse keeper climbed the stairs at dusk, and"))
    draft = torch.tensor(source.tokenizer.encode(" saw the ships coming home"))

    def chain(stage, extra: int = 0):
        kv = stage.new_cache(1024)
        kv.create("s", 256)
        first = stage.forward(kv, "s", prompt, all_logits=True)
        padding = stage.forward(kv, "s", torch.arange(3, 3 + extra), all_logits=False) if extra else None
        return first, padding, stage.forward(kv, "s", draft, all_logits=True)

    calls = []
    real = fast.decode_steps.run
    fast.decode_steps.run = lambda kv, items, plans, *a: calls.append(sum(p.n for p in plans)) or real(kv, items, plans, *a)
    try:
        got = chain(fast)
        whole_block = chain(fast, 128 - len(prompt))  # a chunk holding positions [64, 128) whole: per-op
    finally:
        fast.decode_steps.run = real
    assert calls == [len(prompt), len(draft)] * 2
    for a, b in zip(got, chain(slow)):
        assert (a is None and b is None) or torch.equal(a, b)
    for a, b in zip(whole_block, chain(slow, 128 - len(prompt))):
        assert torch.equal(a, b)


def test_taps_between_layers_see_what_a_stage_ending_there_hands_on_and_change_no_bit(smol):
    """A verifier reads its rows after its exit layers (previews): the kernel then runs in spans."""
    from decoding.batch import BatchItem

    source, fast, slow = smol
    front = source.load_stage(0, 20, torch.float32, packed="gguf")
    prompt, chain = torch.tensor([1, 2, 3, 4, 5, 6, 7]), torch.tensor([9, 10, 11])

    def run(stage, taps=None):
        kv = stage.new_cache(64)
        kv.create("s", 64)
        stage.forward_batch(kv, [BatchItem("s", prompt)])
        return stage.forward_batch(kv, [BatchItem("s", chain, all_logits=stage.is_last)], taps=taps)[0]
    for stage in (fast, slow):
        seen = {}
        tapped = run(stage, {k: (lambda h, k=k: seen.__setitem__(k, h.clone())) for k in (10, 20, 29)})
        assert torch.equal(tapped, run(stage)) and set(seen) == {10, 20, 29}
        assert torch.equal(seen[20], run(front).float())


def test_a_chain_on_a_forked_sequence_reads_the_prefix_in_place_with_the_same_bits(smol):
    """A verify round on a request that reuses a cached prompt: its rows read the parent's positions where
    they lie and their own earlier rows, as the per-operation path does."""
    source, fast, slow = smol
    prompt = torch.tensor(source.tokenizer.encode("A home is a collection of small systems. " * 12))
    draft = torch.tensor(source.tokenizer.encode(" Each of them keeps its own time"))

    def forked_chain(stage):
        kv = stage.new_cache(1024)
        kv.create("parent", 256)
        stage.forward(kv, "parent", prompt[:64], all_logits=False)
        kv.fork("parent", "s", 64)
        stage.forward(kv, "s", prompt[64:], all_logits=False)
        return stage.forward(kv, "s", draft, all_logits=True)

    assert torch.equal(forked_chain(fast), forked_chain(slow))


def test_q_k_v_biases_go_through_the_step_too(tmp_path):
    """Qwen2's q/k/v biases (a tiny Qwen2 stored as Q8_0)."""
    from decoding.loader import open_model
    from tests.support.gguf_convert import write_gguf
    from tests.support.models import build_tiny_checkpoint

    model = build_tiny_checkpoint(tmp_path / "hf", "qwen2", seed=1, tie_word_embeddings=True, intermediate_size=128)
    source = open_model(write_gguf(model, tmp_path / "qwen2.gguf", "Q8_0"))
    fast = gguf_stage(source, True)
    assert fast.decode_steps is not None and fast.layers[0].qkv_bias is not None
    prompt = torch.randint(3, 200, (20,), generator=torch.Generator().manual_seed(2))
    slow = gguf_stage(source, False)
    assert torch.equal(decode(fast, prompt, 12), decode(slow, prompt, 12))
    other = torch.randint(3, 200, (7,), generator=torch.Generator().manual_seed(3))
    for got, want in zip(decode_together(fast, [prompt, other], 12), [decode(slow, prompt, 12), decode(slow, other, 12)]):
        assert torch.equal(got, want)


def test_thread_counts_that_change_within_a_process_keep_the_bits(smol):
    """The mode chooser and the profiler set other thread counts between a daemon's steps: the kernels'
    own pool follows each count up and down, and every step keeps the one-thread bits."""
    source, fast, _ = smol
    prompt = torch.tensor(source.tokenizer.encode("Rain fell on the harbour all night"))
    want = decode(fast, prompt, 6)
    for threads in (3, 2, 4, 1, 3, 2):
        assert torch.equal(decode(fast, prompt, 6, threads=threads), want), threads


@pytest.mark.parametrize("head_dim", [64, 12])
def test_one_row_attention_is_softmax_attention_and_reads_segments_as_one_run(head_dim):
    from decoding.quant.row_ops import row_attention

    g = torch.Generator().manual_seed(4)
    q = torch.randn(6, 1, head_dim, generator=g)
    keys, values = torch.randn(2, 50, head_dim, generator=g), torch.randn(2, 50, head_dim, generator=g)
    scale = head_dim ** -0.5
    got = row_attention(q, [(keys, values)], scale)
    qg = q.view(2, 3, head_dim).double()
    want = (torch.softmax(qg @ keys.double().transpose(1, 2) * scale, -1) @ values.double()).view(6, 1, head_dim)
    assert torch.allclose(got.double(), want, atol=1e-5)
    split = [(keys[:, :17], values[:, :17]), (keys[:, 17:], values[:, 17:])]
    assert torch.equal(row_attention(q, split, scale), got)
