"""``meshd model advise``: which models this home can hold, how fast they would answer, how well.

A home that wants voice control that works needs a 4–8B model, and whether it can run one
depends on its pooled memory and on how fast its devices read weights. This module turns
what is known — each member's memory budget and a measured decode speed on a known model —
into a table of the catalog's models: fits or not, a predicted decode rate, and the
published Home Assistant command success.

The rate is an ESTIMATE, and says so: decoding one token reads every weight once, so a
device's decode time scales with the bytes it holds. From a measured step time on a known
model we get a device's bytes per second; a candidate's layers are laid on the fastest
members first (as much as each one's budget holds), and the token's time is the sum of
each member's bytes over its speed. Network hops and prompt length are left out.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshd.model.hub_models import CommandSuccess

CONTEXT = 256  # tokens already in the cache when the decode step is read off a profile


@dataclass(frozen=True)
class Speed:
    """A measured decode speed: seconds per token on a model of ``file_bytes`` (``runtime_bytes`` once loaded)."""

    step_s: float
    file_bytes: int
    runtime_bytes: int
    source: str  # where the measurement comes from, for the user

    @property
    def bytes_per_s(self) -> float:
        return self.runtime_bytes / self.step_s

    @property
    def growth(self) -> float:
        """How much a model's file grows when loaded in this numeric mode (runtime / file bytes)."""
        return self.runtime_bytes / self.file_bytes if self.file_bytes else 1.0


@dataclass(frozen=True)
class Member:
    name: str
    budget_bytes: int
    speed: Speed


@dataclass(frozen=True)
class Candidate:
    name: str  # what `meshd model pull` and `--model` take
    source: str  # where it comes from ("Hub Qwen/Qwen3-8B-GGUF", "package index")
    file_bytes: int
    success: CommandSuccess | None
    pulled: bool = False


@dataclass(frozen=True)
class Advice:
    candidate: Candidate
    needs_bytes: int  # memory it takes loaded (estimate)
    fits: bool
    devices: int  # members it would be spread over
    tokens_per_s: float | None  # predicted decode rate (None: does not fit)


def advise(members: list[Member], candidates: list[Candidate]) -> list[Advice]:
    """Each candidate against the home: best command success first, then the faster."""
    out = []
    for c in candidates:
        growth = members[0].speed.growth if members else 1.0
        need = int(c.file_bytes * growth)
        left, seconds, used = need, 0.0, 0
        for m in sorted(members, key=lambda m: -m.speed.bytes_per_s):
            if left <= 0:
                break
            take = min(left, m.budget_bytes)
            if take <= 0:
                continue
            seconds += take / m.speed.bytes_per_s
            left -= take
            used += 1
        fits = left <= 0
        out.append(Advice(c, need, fits, used if fits else 0, 1.0 / seconds if fits and seconds > 0 else None))
    return sorted(out, key=lambda a: (not a.fits, -(a.candidate.success.percent if a.candidate.success else -1),
                                      -(a.tokens_per_s or 0.0)))


def speed_from_profile(data: dict, file_bytes: int | None, source: str) -> Speed | None:
    """A profile's decode step near ``CONTEXT`` tokens, over its model's weights; None when it has none."""
    ctx, steps = data.get("decode_context") or [], data.get("decode_step_s") or []
    runtime = int(sum(data.get("weight_bytes") or []))
    if not ctx or len(ctx) != len(steps) or runtime <= 0:
        return None
    step = min(zip(ctx, steps), key=lambda cs: abs(cs[0] - CONTEXT))[1]
    if not step > 0:
        return None
    return Speed(float(step), int(file_bytes or runtime), runtime, source)


__all__ = ["Speed", "Member", "Candidate", "Advice", "advise", "speed_from_profile"]
