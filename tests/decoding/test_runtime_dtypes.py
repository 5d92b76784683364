"""bfloat16 / float16 runtimes are selectable and stay close to float32."""

import pytest
import torch

from decoding.generate import generate
from decoding.loader import open_model
from decoding.pipeline_local import LocalPipeline


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 0.25), (torch.float16, 0.05)])
def test_reduced_precision_stages_track_float32_logits(tiny_llama, dtype, tol):
    src = open_model(tiny_llama[0])
    ids = list(range(3, 40))
    ref = LocalPipeline.from_source(src, 1)
    ref.create("s", 64)
    want = ref.prefill("s", ids, all_logits=True)
    pipe = LocalPipeline.from_source(src, 2, dtype)
    assert pipe.stages[0].layers[0].qkv.dtype == dtype
    assert pipe.caches[1].dtype == dtype
    pipe.create("s", 64)
    got = pipe.prefill("s", ids, chunks=3, all_logits=True)
    assert got.dtype == torch.float32  # logits are handed out in float32 whatever the runtime dtype
    assert (got - want[-got.shape[0]:]).abs().max().item() < tol  # prefill returns the last chunk's logits
    assert len(generate(LocalPipeline.from_source(src, 1, dtype), ids, 8).token_ids) == 8
