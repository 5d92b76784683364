"""A drafter in this process: the home's small model on an in-process pipeline.

The daemon drafts through the mesh (``meshd.pipeline``); this one serves
``meshd generate --cloud``, the benchmarks and the tests, and is the
reference the mesh drafter is held against.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from decoding.offload.loop import SUPPORT_MAX, DraftStep, draft_step
from decoding.offload.policy import GAMMA
from decoding.pipeline_local import LocalPipeline
from decoding.sampling import Sampler, SamplingParams, filtered_probs
from decoding.batch import BatchItem


class LocalDrafter:
    def __init__(self, pipeline: LocalPipeline, sampling: SamplingParams = SamplingParams(), capacity: int = 256,
                 seq_id: str = "draft", attention_tail: int = GAMMA):
        self.pipeline = pipeline
        self.sampler = Sampler(sampling)
        self.seq_id = seq_id
        self.attention_tail = attention_tail
        self.feeds = 0
        pipeline.create(seq_id, capacity)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="drafter")
        # A feed of several tokens gives each row the bits it would get alone: the gguf mode's block products
        # and its attention per row do; float matrix products over several rows need not.
        self.batch_invariant = all(getattr(st, "packing", "") == "gguf" for st in pipeline.stages)

    async def feed(self, tokens: Sequence[int], at: int) -> DraftStep:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.feed_sync, list(tokens), at)

    @torch.inference_mode()
    def feed_sync(self, tokens: list[int], at: int) -> DraftStep:
        p = self.pipeline
        have = p.caches[0].length(self.seq_id)
        if at > have:
            raise ValueError(f"cannot feed at {at}: the drafter holds {have} positions")
        if at < have:
            p.truncate(self.seq_id, at)
        x = torch.tensor(tokens, dtype=torch.long)
        probes: dict = {}
        for stage, cache in zip(p.stages, p.caches):
            item = BatchItem(self.seq_id, x, all_logits=False, head=stage.is_last,
                             attention_tail=self.attention_tail if stage.is_last else 0)
            x = stage.forward_batch(cache, [item], probes if stage.is_last else None)[0]
        self.feeds += 1
        logits = x[-1]
        params = self.sampler.params
        probs = torch.softmax(logits.float(), -1) if params.greedy else filtered_probs(logits, params)
        top = torch.topk(probs, min(SUPPORT_MAX + 1, probs.shape[-1]))
        token = self.sampler(logits)
        att = probes[0][-1].tolist() if 0 in probes else None
        return draft_step(token, top.indices.tolist(), top.values.tolist(), att)

    def close(self) -> None:
        self.pipeline.free(self.seq_id)
        self._pool.shutdown(wait=False)
