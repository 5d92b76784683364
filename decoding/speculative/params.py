"""What a request asks of speculative decoding, parsed once at the API edge.

The API's extension field is ``speculative: "auto" | "off" | {...}``. Auto lets
the engine pick a drafter that pays off on this mesh (or none); an object
names a drafter and may cap the candidates per verify round. Medusa's
*typical acceptance* is lossy, so it is only ever used when a request opts in
with ``"typical": true`` — never by default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from decoding.errors import BadSpeculativeParams

DRAFTERS = ("medusa", "lookup", "draft_model")
MAX_CANDIDATES = 64  # tokens per verify round beyond the root: the tree budget

Mode = Literal["auto", "off", "on"]


@dataclass(frozen=True)
class SpeculativeParams:
    mode: Mode = "auto"
    drafter: str | None = None  # None with mode "auto": the engine chooses
    max_candidates: int | None = None  # None: adaptive
    typical: bool = False  # lossy Medusa typical acceptance (explicit opt-in only)
    draft_model: str | None = None  # for drafter "draft_model": a model name or path

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "drafter": self.drafter, "max_candidates": self.max_candidates,
                "typical": self.typical, "draft_model": self.draft_model}

    @classmethod
    def parse(cls, value: Any) -> "SpeculativeParams":
        """From the request's JSON value (None = the default, auto); raises BadSpeculativeParams."""
        if value is None or value == "auto":
            return cls()
        if value == "off" or value is False:
            return cls(mode="off")
        if value is True:
            return cls(mode="on")
        if not isinstance(value, dict):
            raise BadSpeculativeParams(
                f'speculative must be "auto", "off" or an object, got {type(value).__name__}')
        unknown = set(value) - {"drafter", "max_candidates", "typical", "draft_model"}
        if unknown:
            raise BadSpeculativeParams(f"speculative: unknown field(s) {sorted(unknown)}; allowed: "
                                       "drafter, max_candidates, typical, draft_model")
        drafter = value.get("drafter")
        if drafter is not None and drafter not in DRAFTERS + ("auto", "off"):
            raise BadSpeculativeParams(f"speculative.drafter must be one of {list(DRAFTERS)}, got {drafter!r}")
        if drafter == "off":
            return cls(mode="off")
        mc = value.get("max_candidates")
        if mc is not None and (isinstance(mc, bool) or not isinstance(mc, int) or not 1 <= mc <= MAX_CANDIDATES):
            raise BadSpeculativeParams(f"speculative.max_candidates must be an integer in [1, {MAX_CANDIDATES}]")
        typical = value.get("typical", False)
        if not isinstance(typical, bool):
            raise BadSpeculativeParams("speculative.typical must be true or false")
        dm = value.get("draft_model")
        if dm is not None and (not isinstance(dm, str) or not dm or len(dm) > 4096):
            raise BadSpeculativeParams("speculative.draft_model must be a non-empty string")
        if dm is not None and drafter not in (None, "draft_model"):
            raise BadSpeculativeParams("speculative.draft_model only applies to drafter \"draft_model\"")
        if typical and drafter not in (None, "medusa"):
            raise BadSpeculativeParams("speculative.typical only applies to drafter \"medusa\"")
        if drafter is None and dm is not None:
            drafter = "draft_model"
        mode: Mode = "on" if drafter not in (None, "auto") else "auto"
        return cls(mode=mode, drafter=None if drafter == "auto" else drafter, max_candidates=mc,
                   typical=typical, draft_model=dm)


@dataclass(frozen=True)
class SpeculativeStats:
    """Per-request accounting the API reports in ``usage.speculative``."""

    drafter: str | None  # what actually ran (None: plain decoding)
    rounds: int = 0
    drafted: int = 0  # candidate tokens sent for verification
    accepted: int = 0  # candidates accepted (bonus tokens not counted)
    fallback_reason: str | None = None
    constrained: bool = False  # drafted under a grammar (drafted / accepted are then under it)
    forced_drafted: int = 0  # of the candidates: tokens of the grammar's forced text
    forced_accepted: int = 0
    steps: int = 0  # passes through the model that produced tokens (the first token's included)
    tokens: int = 0  # tokens they produced

    @property
    def accepted_per_round(self) -> float:
        """Tokens committed per verify round (accepted candidates + the round's own token)."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def steps_per_token(self) -> float:
        """Model steps per generated token: 1.0 for plain decoding, lower the more drafts were taken."""
        return self.steps / self.tokens if self.tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"drafter": self.drafter, "rounds": self.rounds, "drafted": self.drafted,
                             "accepted": self.accepted,
                             "accepted_per_round": round(self.accepted_per_round, 3),
                             "steps": self.steps, "tokens": self.tokens,
                             "steps_per_token": round(self.steps_per_token, 3)}
        if self.constrained:
            d.update(constrained=True, forced_drafted=self.forced_drafted, forced_accepted=self.forced_accepted)
        if self.fallback_reason:
            d["fallback_reason"] = self.fallback_reason
        return d
