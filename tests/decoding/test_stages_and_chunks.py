"""Splitting the model into stages and the prompt into sub-sequences changes nothing in the output."""

import pytest
import torch

from decoding.generate import generate
from decoding.loader import open_model
from decoding.pipeline_local import LocalPipeline, chunk_bounds, even_split
from decoding.sampling import SamplingParams

TOL = 1e-4


def test_even_split_covers_all_layers_contiguously():
    assert even_split(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert chunk_bounds(10, cuts=[3, 7]) == [(0, 3), (3, 7), (7, 10)]
    assert chunk_bounds(5, chunks=9) == [(i, i + 1) for i in range(5)]


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return open_model(tiny_llama[0])


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("split", [{"chunks": 1}, {"chunks": 2}, {"chunks": 4}, {"cuts": [1, 2, 9, 30]}])
def test_staged_chunked_prefill_logits_equal_one_pass(tiny, stages, split):
    ids = torch.randint(0, 211, (37,), generator=torch.Generator().manual_seed(5)).tolist()
    ref = LocalPipeline.from_source(tiny, 1)
    ref.create("s", 64)
    want = ref.prefill("s", ids, all_logits=True)
    pipe = LocalPipeline.from_source(tiny, stages)
    pipe.create("s", 64)
    got = torch.cat([pipe.forward("s", torch.tensor(ids[a:b]), all_logits=True)
                     for a, b in chunk_bounds(len(ids), split.get("chunks"), split.get("cuts"))])
    assert (got - want).abs().max().item() < TOL


@pytest.mark.parametrize("stages,chunks", [(2, 3), (4, 2)])
def test_tiny_greedy_generation_identical_for_64_tokens(tiny, stages, chunks):
    ids = list(range(3, 40))
    ref = generate(LocalPipeline.from_source(tiny, 1), ids, 64)
    got = generate(LocalPipeline.from_source(tiny, stages), ids, 64, chunks=chunks)
    assert len(ref.token_ids) == 64 and got.token_ids == ref.token_ids


@pytest.mark.slow
@pytest.mark.parametrize("stages,chunks", [(2, 4), (3, 2)])
def test_real_model_greedy_identical_across_stages_and_chunks(real_source, stages, chunks):
    tok = real_source.tokenizer
    ids = tok.apply_chat([{"role": "user", "content": "List three ways to save energy at home."}])
    ref = generate(LocalPipeline.from_source(real_source, 1), ids, 64, eos_ids=())
    got = generate(LocalPipeline.from_source(real_source, stages), ids, 64, eos_ids=(), chunks=chunks)
    assert got.token_ids == ref.token_ids


def test_seeded_sampling_is_reproducible_and_stage_independent(tiny):
    p = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=1234)
    ids = list(range(5, 30))
    a = generate(LocalPipeline.from_source(tiny, 1), ids, 40, p)
    b = generate(LocalPipeline.from_source(tiny, 3), ids, 40, p, chunks=3)
    c = generate(LocalPipeline.from_source(tiny, 1), ids, 40, SamplingParams(0.9, 50, 0.9, seed=99))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7])
def test_the_fast_cpu_linear_gives_what_f_linear_gives(rows):
    """Small-row products take oneDNN's inference path on CPU; the rows that come back are the same."""
    import torch.nn.functional as F

    from decoding.linear import linear

    g = torch.Generator().manual_seed(rows)
    x, w, b = torch.randn(rows, 64, generator=g), torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    out = linear(x, w, b)
    assert out.shape == (rows, 96)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
