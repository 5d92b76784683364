"""Speculative generation on one device (or K in-process stages): the reference twin.

The mesh runs the same rounds through real stages on real devices; this
version runs them in-process, so tests can hold the two against each other
and against plain greedy decoding, and ``meshd generate --speculative`` can
show what each drafter does for a prompt without a daemon.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from decoding.detok import IncrementalDetokenizer
from decoding.generate import GenerationResult, check_fits, selector_of
from decoding.pipeline_local import LocalPipeline
from decoding.sampling import Sampler, SamplingParams, SamplingSpec
from decoding.selector import TokenSelector
from decoding.speculative.medusa_propose import path_values, propose_sequences
from decoding.speculative.params import SpeculativeStats
from decoding.speculative.session import MedusaProposal, SpeculationSession
from decoding.speculative.tree import DraftTree
from decoding.speculative.verify import Verdict, verify_sampled, verify_shaped, verify_typical


@dataclass
class SpeculativeResult(GenerationResult):
    speculative: SpeculativeStats | None = None


class MedusaSource:
    """Medusa heads bound to a model's LM head and a tree: proposals from a normed hidden state.

    The heads run where the LM head is (a GPU last stage keeps its LM head there), so
    they are copied to that device once here — not moved in place: one loaded heads
    object may serve stages on different devices in one process.
    """

    def __init__(self, heads, lm_head: torch.Tensor, paths=None):
        device = lm_head.device
        if isinstance(heads, torch.nn.Module) and any(p.device != device for p in heads.parameters()):
            heads = copy.deepcopy(heads).to(device)
        self.heads = heads
        self.lm_head = lm_head
        self._device = None if device.type == "cpu" else device
        self.paths = [tuple(p) for p in (paths if paths is not None else heads.tree)]
        acc = (heads.meta or {}).get("topk_accuracy") if hasattr(heads, "meta") else None
        self.values = path_values(self.paths, acc)

    def propose(self, hidden: torch.Tensor, limit: int | None = None) -> MedusaProposal:
        paths = self.paths if limit is None else self.paths[:limit]
        if self._device is not None:  # a host hidden state (a stage's output) for heads on a GPU
            hidden = hidden.to(self._device)
        return MedusaProposal(propose_sequences(self.heads, hidden, self.lm_head, paths),
                              self.values[:len(paths)])


def verify(tree: DraftTree, logits: torch.Tensor, sampler: Sampler, typical: bool = False) -> Verdict:
    if typical:
        return verify_typical(tree, logits, sampler.params, sampler.uniform)
    return verify_sampled(tree, logits, sampler.params, sampler.uniform)


def speculative_generate(pipeline: LocalPipeline, prompt_ids: list[int], max_new_tokens: int = 64,
                         sampling: SamplingParams | SamplingSpec = SamplingParams(), eos_ids=(),
                         drafter: str = "lookup",
                         medusa: MedusaSource | None = None, model_drafter=None, typical: bool = False,
                         max_candidates: int = 64, fixed: int | None = None, tokenizer=None,
                         on_text: Callable[[str], None] | None = None, seq_id="spec",
                         cost=None) -> SpeculativeResult:
    check_fits(len(prompt_ids), max_new_tokens, pipeline.config.max_position)
    capacity = min(len(prompt_ids) + max_new_tokens + max_candidates + 1, pipeline.config.max_position)
    sampler = selector_of(sampling, pipeline, tokenizer)
    shaped = isinstance(sampler, TokenSelector)
    detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
    kw = {} if cost is None else {"cost": cost}
    session = SpeculationSession(drafter, list(prompt_ids), max_candidates=max_candidates, fixed=fixed,
                                 model_drafter=model_drafter, **kw)
    if shaped and sampler.constraint is not None:  # the drafts' own copy of the grammar
        from decoding.constrained import constraint_for

        session.follow_grammar(constraint_for(sampling.constraint, tokenizer, pipeline.config.vocab_size),
                               tokenizer.eos_ids)
    pipeline.create(seq_id, capacity)
    out: list[int] = []
    finish = "length"
    t0 = time.perf_counter()
    t_first = None
    try:
        logits, hidden = pipeline.prefill(seq_id, list(prompt_ids), return_normed=True)
        tok = sampler(logits[-1])
        t_first = time.perf_counter()
        pending = [tok]
        proposal = medusa.propose(hidden[-1]) if medusa is not None and session.uses_medusa else None
        session.extend([tok])
        while True:
            for t in pending:
                if t in eos_ids:
                    finish = "stop"
                    break
                out.append(t)
                if detok is not None and on_text is not None:
                    delta = detok.push(t)
                    if delta:
                        on_text(delta)
                if len(out) >= max_new_tokens:
                    break
            if shaped and sampler.finished:
                finish = "stop"
            if finish == "stop" or len(out) >= max_new_tokens:
                break
            n = len(session.context) - 1  # positions in the cache; the root is not yet
            tree = session.next_tree(proposal)
            room = min(max_new_tokens - len(out) - 1, capacity - n - 1)
            tree = tree.truncated(max(0, room))
            logits, hidden = pipeline.forward(seq_id, torch.tensor(tree.tokens, dtype=torch.long, device="cpu"),
                                              tree_mask=tree.mask(), all_logits=True, return_normed=True)
            verdict = (verify_shaped(tree, logits, sampler, lambda t: t in eos_ids or sampler.finished) if shaped
                       else verify(tree, logits, sampler, typical))
            pipeline.keep(seq_id, n, list(verdict.path))
            proposal = None
            if medusa is not None and session.wants_medusa:
                proposal = medusa.propose(hidden[verdict.path[-1]])
            pending = session.commit(tree, verdict)
        t_end = time.perf_counter()
        if detok is not None and on_text is not None:
            tail = detok.flush()
            if tail:
                on_text(tail)
    finally:
        pipeline.free(seq_id)
        if model_drafter is not None:
            model_drafter.close()
    text = tokenizer.decode(out) if tokenizer is not None else ""
    return SpeculativeResult(out, text, len(prompt_ids), (t_first or t_end) - t0, t_end - (t_first or t_end),
                             finish, pipeline.layer_ranges, speculative=session.stats())
