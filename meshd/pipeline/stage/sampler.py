"""The last stage's sampler: logits to tokens, speculative verification, Medusa proposals.

It runs in the compute thread, in the same hop as the forward, so only a few
token ids (and optionally the top-k probabilities a verifier needs, never the
full logits) travel back to the coordinator. A sequence's sampling state (its
seeded random stream, grammar, penalties) is built from the message that first
asks for a token (:func:`selector_for`) and kept in the sequence's slot, so it
goes when the scheduler frees the sequence.
"""

from __future__ import annotations

import asyncio
import dataclasses

import torch

from decoding.errors import DecodingError
from decoding.exits.bound import ExitCheck
from decoding.head_rows import HeadRows
from decoding.sampling import filtered_probs
from decoding.selector import TokenSelector
from decoding.speculative.generate import verify
from decoding.speculative.params import MAX_CANDIDATES
from decoding.speculative.verify import verify_shaped
from decoding.models import StageModel
from meshd.log import get_logger
from meshd.pipeline.stage.worker import Work
from meshd.pipeline.tensor.grouped import GroupedStage
from transport.stage_messages import StageForward, TokenResult

log = get_logger("meshd.stage")

__all__ = ["StageSampler", "selector_for"]


def selector_for(msg: StageForward, source, vocab_size: int) -> TokenSelector:
    """How a sequence turns logits into tokens, from the message that first asks for one.

    The one place that reads a ``StageForward``'s sampling fields (sampling,
    grammar, penalties and the history a replay rebuilds them from).
    """
    spec = msg.sampling
    return TokenSelector.for_spec(spec, tokenizer=source.tokenizer if spec.constraint is not None else None,
                                  vocab_size=vocab_size, prompt_tail=msg.prompt_tail or (),
                                  history=msg.history or (), skip=msg.sample_step)


class _GrammarRows:
    """A lazy head's rows as ``selector`` reads them: each multiplied over the tokens its grammar allows
    at the moment it is read (the walk of a verify round reads a row after the tokens before it)."""

    def __init__(self, rows: HeadRows, selector: TokenSelector):
        self.rows, self.selector = rows, selector

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.rows.row(int(i), self.selector.allowed())

    def __len__(self) -> int:
        return len(self.rows)


class StageSampler:
    def __init__(self, source, medusa=None):
        """``medusa(stage)`` -> MedusaSource (or raises DrafterError): the heads, loaded on first use."""
        self.source = source
        self._medusa_factory = medusa
        self._medusa = None
        self._medusa_error = ""  # why there are no heads (kept until the next plan)

    def reset(self) -> None:
        """A new plan: the heads are loaded again on first use (they may belong to other layers' stage)."""
        self._medusa, self._medusa_error = None, ""

    def answer(self, stage: StageModel, work: Work, out, probe: torch.Tensor | None) -> TokenResult:
        """The last stage's answer (compute thread): a sampled token, or a verified round."""
        msg = work.msg
        if isinstance(out, ExitCheck):  # the token left at an exit layer: drawn from that exit's distribution
            result = self._sample(stage, work, out.logits.to("cpu"))
            return dataclasses.replace(result, exit_layer=out.layer)
        logits, hidden = out if work.normed else (out, None)
        if isinstance(logits, HeadRows):  # rows computed as the selector reads them, over its grammar's tokens
            logits = _GrammarRows(logits, self._selector(stage, work))
        if work.tree is not None:
            result = self._verify(stage, work, logits, hidden)
        else:
            result = self._sample(stage, work, logits[-1])
            if msg.medusa_paths > 0:
                result = self._with_proposals(stage, result, hidden[-1], msg.medusa_paths)
        if probe is not None:  # the drafter of a cloud-verified answer judges importance from it
            result = dataclasses.replace(result, attention=[float(a) for a in probe[-1].tolist()])
        return result

    def _selector(self, stage: StageModel, work: Work) -> TokenSelector:
        slot = work.slot
        if slot.selector is None:
            slot.selector = selector_for(work.msg, self.source, stage.config.vocab_size)
        return slot.selector

    def _verify(self, stage: StageModel, work: Work, logits: torch.Tensor, hidden: torch.Tensor) -> TokenResult:
        """Acceptance at the last stage. This stage's own KV rollback waits, like every other stage's,
        for the next round's header."""
        msg, tree = work.msg, work.tree
        sel = self._selector(stage, work)
        if sel.plain:
            verdict = verify(tree, logits, sel.sampler, msg.typical)
        else:  # the grammar / penalties move with every committed token: the selector walks the tree
            verdict = verify_shaped(tree, logits, sel, lambda t: t in sel.eos_ids or sel.finished)
        result = TokenResult(request_id=msg.request_id, plan_version=msg.plan_version, seq_id=msg.seq_id,
                             token_ids=torch.tensor(verdict.committed(tree), dtype=torch.long),
                             chunk_index=msg.chunk_index, path=list(verdict.path), finished=sel.finished)
        if msg.medusa_paths > 0:
            result = self._with_proposals(stage, result, hidden[verdict.path[-1]], msg.medusa_paths)
        return result

    def _sample(self, stage: StageModel, work: Work, logits: torch.Tensor) -> TokenResult:
        msg = work.msg
        selector = self._selector(stage, work)
        token = selector(logits)
        topk_ids = topk_probs = None
        if msg.return_topk > 0:  # the compressed distribution a verifier needs, instead of 49k logits
            params = selector.sampler.params
            probs = torch.softmax(logits.float(), -1) if params.greedy else filtered_probs(logits, params)
            top = torch.topk(probs, min(msg.return_topk, probs.shape[-1]))
            topk_ids, topk_probs = top.indices.to(torch.int64), top.values.to(torch.float32)
        return TokenResult(request_id=msg.request_id, plan_version=msg.plan_version, seq_id=msg.seq_id,
                           token_ids=torch.tensor([token], dtype=torch.long), chunk_index=msg.chunk_index,
                           topk_ids=topk_ids, topk_probs=topk_probs, finished=selector.finished)

    def _with_proposals(self, stage: StageModel, result: TokenResult, hidden: torch.Tensor,
                        paths: int) -> TokenResult:
        prop, note = self._propose(stage, hidden, paths)
        if prop is None:
            return dataclasses.replace(result, note=note)
        return dataclasses.replace(result, proposals=prop.sequences, proposal_values=list(prop.values))

    def _propose(self, stage: StageModel, hidden: torch.Tensor, paths: int):
        if self._medusa is None and not self._medusa_error:
            try:
                if isinstance(stage, GroupedStage):
                    raise DecodingError("a tensor group's LM head is split between its members")
                if self._medusa_factory is None:
                    raise DecodingError("no Medusa heads are configured for this model")
                self._medusa = self._medusa_factory(stage)
            except Exception as exc:  # noqa: BLE001 - drafting is optional: never fail a request over it
                self._medusa_error = str(exc) if isinstance(exc, (DecodingError, OSError)) else repr(exc)
                log.warning("medusa_unavailable", error=self._medusa_error)
        if self._medusa is None:
            return None, f"medusa heads unavailable: {self._medusa_error}"
        return self._medusa.propose(hidden, min(int(paths), MAX_CANDIDATES)), ""

    def warm_grammar(self, stage: StageModel) -> None:
        """This stage samples: set the grammar engine up for the vocabulary in the background, so the
        first tool-calling or structured request does not wait for it."""
        try:
            tok = self.source.tokenizer
        except Exception:  # noqa: BLE001 - a model without a tokenizer (token ids only) has no grammar
            return
        if getattr(tok, "path", None) is None:
            return
        from decoding.constrained import warm

        vocab = stage.config.vocab_size

        def run() -> None:
            try:
                warm(tok.path, vocab, tuple(tok.eos_ids))
            except Exception as exc:  # noqa: BLE001 - only a head start; a real request reports errors
                log.warning("grammar_warm_failed", error=f"{type(exc).__name__}: {exc}")

        asyncio.get_running_loop().run_in_executor(None, run)
