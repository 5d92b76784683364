"""Reference generation: the output every distributed or speculative path must reproduce."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from decoding.detok import IncrementalDetokenizer
from decoding.errors import ContextOverflow
from decoding.pipeline_local import LocalPipeline
from decoding.sampling import Sampler, SamplingParams, SamplingSpec


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    prompt_tokens: int
    ttft_s: float
    decode_s: float
    finish_reason: str  # "stop" (EOS) or "length"
    layer_ranges: list[tuple[int, int]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput: tokens after the first over the time after the first."""
        n = len(self.token_ids) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


def check_fits(prompt_len: int, max_new_tokens: int, context: int) -> None:
    if prompt_len == 0:
        raise ContextOverflow("empty prompt")
    if prompt_len >= context:
        raise ContextOverflow(
            f"prompt is {prompt_len} tokens; the model's context is {context} tokens")
    if prompt_len + max_new_tokens > context:
        raise ContextOverflow(
            f"prompt ({prompt_len}) + max_tokens ({max_new_tokens}) exceeds the context of {context} tokens")


def selector_of(sampling: SamplingParams | SamplingSpec, pipeline: LocalPipeline, tokenizer=None):
    """What turns a row of logits into the next token: a plain sampler, or (for a spec with a grammar
    or penalties) a :class:`~decoding.selector.TokenSelector` that shapes the row and moves with
    each token; its grammar reads ``tokenizer`` (``path``, ``eos_ids``)."""
    if isinstance(sampling, SamplingParams):
        return Sampler(sampling)
    if not sampling.shaped:
        return Sampler(sampling.params)
    from decoding.selector import TokenSelector

    return TokenSelector.for_spec(sampling, tokenizer=tokenizer, vocab_size=pipeline.config.vocab_size)


def generate(pipeline: LocalPipeline, prompt_ids: list[int], max_new_tokens: int = 64,
             sampling: SamplingParams | SamplingSpec = SamplingParams(), eos_ids=(), chunks: int = 1,
             cuts: list[int] | None = None, tokenizer=None,
             on_text: Callable[[str], None] | None = None, seq_id="gen") -> GenerationResult:
    """``sampling``: plain parameters, or a spec whose grammar / penalties shape every token (a
    grammar that is complete ends the answer, as an end-of-sequence token would)."""
    check_fits(len(prompt_ids), max_new_tokens, pipeline.config.max_position)
    sampler = selector_of(sampling, pipeline, tokenizer)
    detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
    pipeline.create(seq_id, len(prompt_ids) + max_new_tokens)
    out: list[int] = []
    finish = "length"
    try:
        t0 = time.perf_counter()
        logits = pipeline.prefill(seq_id, prompt_ids, chunks=chunks, cuts=cuts)
        t_first = None
        for i in range(max_new_tokens):
            tok = sampler(logits[-1])
            if t_first is None:
                t_first = time.perf_counter()
            if tok in eos_ids:
                finish = "stop"
                break
            out.append(tok)
            if detok is not None and on_text is not None:
                delta = detok.push(tok)
                if delta:
                    on_text(delta)
            if getattr(sampler, "finished", False):
                finish = "stop"
                break
            if i + 1 < max_new_tokens:
                logits = pipeline.forward(seq_id, torch.tensor([tok], dtype=torch.long, device="cpu"))
        t_end = time.perf_counter()
        if detok is not None and on_text is not None:
            tail = detok.flush()  # an incomplete character held back at the very end
            if tail:
                on_text(tail)
    finally:
        pipeline.free(seq_id)
    text = tokenizer.decode(out) if tokenizer is not None else ""
    return GenerationResult(out, text, len(prompt_ids), (t_first or t_end) - t0,
                            t_end - (t_first or t_end), finish, pipeline.layer_ranges)
