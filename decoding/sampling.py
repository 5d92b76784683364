"""Token selection: greedy, or temperature / top-k / top-p sampling with a seed.

A request's sampler owns its own torch.Generator, seeded once, and draws exactly
one uniform number per sampled token. Wherever the last stage lives, the same
seed therefore yields the same tokens as the single-device reference.

Sampling happens on the host, in float32 / float64, whatever device computed the
logits (a GPU stage's are moved over once per message; ``filtered_probs`` moves
any that were not): the draw, the generator and the cumulative sum are then the
same on every device, so a CPU device and a GPU device pick the same token from
the same probabilities, and ``searchsorted`` never sees tensors on two devices.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from decoding.errors import DecodingError
from decoding.penalties import Penalties


class BadSamplingParams(DecodingError):
    pass


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise BadSamplingParams(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise BadSamplingParams(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise BadSamplingParams(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_dict(self) -> dict:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p, "seed": self.seed}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SamplingParams:
        """The inverse of :meth:`to_dict`, for values a peer sent: a wrong type is
        :class:`BadSamplingParams` too (absent keys take the defaults)."""
        try:
            seed = d.get("seed")
            return cls(float(d.get("temperature", 0.0)), int(d.get("top_k", 0)), float(d.get("top_p", 1.0)),
                       None if seed is None else int(seed))
        except (TypeError, ValueError) as exc:
            raise BadSamplingParams(f"bad sampling parameters: {exc}") from None

    def with_seed(self, seed: int | None) -> SamplingParams:
        return replace(self, seed=seed)


ConstraintSpec = dict[str, Any]
"""A structured-output grammar spec as :mod:`decoding.constrained` reads it
(``{"type": "json_schema", "schema": ...}``); compiled only where tokens are chosen."""


@dataclass(frozen=True)
class SamplingSpec:
    """How a request wants its tokens chosen: the one value that travels from the API's
    parsers through the engine and the coordinator to the sampler of the last stage.

    Three parts because three different things act on the logits, in this order:
    ``penalties`` (repetition), ``constraint`` (a grammar mask), ``params`` (the draw).
    :class:`decoding.selector.TokenSelector` applies all three; the speculative and
    cloud verifiers need the draw only, and refuse a shaped spec. The constraint is
    a plain spec, not a compiled grammar: compiling needs the tokenizer, which only
    the stage that samples holds. Treat it as read-only.
    """

    params: SamplingParams = field(default_factory=SamplingParams)
    penalties: Penalties = field(default_factory=Penalties)
    constraint: ConstraintSpec | None = None

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    @property
    def shaped(self) -> bool:
        """Penalties or a grammar change the model's distribution: speculation cannot verify it."""
        return self.constraint is not None or self.penalties.active

    def with_seed(self, seed: int | None) -> SamplingSpec:
        return replace(self, params=self.params.with_seed(seed))

    def with_constraint(self, constraint: ConstraintSpec | None) -> SamplingSpec:
        return replace(self, constraint=constraint)

    def unshaped(self) -> SamplingSpec:
        """The draw alone: what a message carries once the shaping has reached the sampler."""
        return self if not self.shaped else SamplingSpec(self.params)


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution actually sampled from (after temperature, top-k, top-p), float32 [vocab] on the host."""
    if logits.device.type != "cpu":
        logits = logits.cpu()
    logits = logits.float() / max(p.temperature, 1e-6)
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        drop = cum - sorted_p >= p.top_p  # keep the smallest prefix reaching top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
        probs = probs / probs.sum()
    return probs


def inverse_cdf(probs: torch.Tensor, u: float) -> int:
    """The token a uniform draw ``u`` in [0, 1) picks from ``probs`` (one draw per token: reproducible)."""
    if probs.device.type != "cpu":
        probs = probs.cpu()
    cdf = torch.cumsum(probs.double(), dim=-1)
    idx = torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64, device="cpu")).item()
    return int(min(idx, probs.shape[-1] - 1))


class Sampler:
    """``skip``: draws already spent by earlier tokens of the same request.

    A request replayed on a new plan (a device left) gets a fresh sampler on a
    new last stage; skipping the draws its earlier tokens used makes the rest
    of the answer identical to an uninterrupted run with the same seed.

    Every sampled token costs exactly one uniform draw, also when speculative
    verification picks it (it samples each visited tree node with the next
    draw and follows the child that matches), so speculative and plain seeded
    sampling produce the same tokens and ``draws`` equals tokens sampled.
    """

    def __init__(self, params: SamplingParams, skip: int = 0):
        self.params = params
        self._gen = None
        self.draws = 0
        if not params.greedy:
            self._gen = torch.Generator()
            self._gen.manual_seed(params.seed if params.seed is not None else torch.seed())
            for _ in range(max(0, int(skip))):  # one draw per token, exactly as __call__ spends them
                self.uniform()
        self.draws = max(0, int(skip))

    def fork(self) -> "Sampler":
        """A sampler that makes this one's next draws without spending them here: a cloud verifier's
        preview walks the drafts with the uniforms its final verdict will use."""
        twin = Sampler(SamplingParams())  # (greedy: makes no generator, so seeds nothing)
        twin.params, twin.draws = self.params, self.draws
        if self._gen is not None:
            twin._gen = torch.Generator()
            twin._gen.set_state(self._gen.get_state())
        return twin

    def uniform(self) -> float:
        self.draws += 1
        return torch.rand((), generator=self._gen, dtype=torch.float64, device="cpu").item()

    def __call__(self, logits: torch.Tensor) -> int:
        """logits: [vocab] of the position to predict."""
        if self.params.greedy:
            self.draws += 1
            return int(torch.argmax(logits))
        return inverse_cdf(filtered_probs(logits, self.params), self.uniform())
