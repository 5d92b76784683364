"""Whether a request is answered in outline mode — decided from the request alone, before any token.

An outline answer first writes its outline, title by title, one sequential
token after another, and only then streams the answer: seconds of time to
first token on a CPU mesh, repaid only when the answer is a list of several
substantial points. Deciding after the outline is written (the budget left no
room, the model wrote two points) is too late: the seconds are spent. So
everything that can rule outline mode out is checked here first, cheaply —
the request's shape, its token budget, an explicit ask for a short answer, the
router's score — microseconds, never a token generated.

``outline: "on"`` is the user's explicit ask: only what makes an outline
impossible refuses it (a 400 naming why). ``"auto"`` declines whenever an
outline might not pay, with a reason code that the coordinator counts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Protocol

from meshd.engine.errors import BadEngineRequest
from meshd.engine.modes import Mode
from meshd.pipeline.outline.decoder import MIN_POINT_TOKENS, MIN_POINTS, TITLE_TOKENS

HEADER_TOKENS = 4  # what a point's header adds to its title: a line break, "k", "." and ":"
# Below this no outline fits at all: every point needs its header and a paragraph of MIN_POINT_TOKENS.
MIN_ANSWER_TOKENS = MIN_POINTS * (HEADER_TOKENS + MIN_POINT_TOKENS)
# From this on MIN_POINTS points fit however long their titles run, so "auto" never falls back for room.
SURE_ANSWER_TOKENS = MIN_POINTS * (HEADER_TOKENS + TITLE_TOKENS + MIN_POINT_TOKENS)
# "auto" outlines only with room where an outline was measured to pay: with 256 tokens outline answers
# came 2.17x sooner end to end on suited questions (bench/RESULTS.md, issue #12); with 160 they took as
# long as plain answers (bench/outline_gate.py) while their first token came 15x later.
PAYING_ANSWER_TOKENS = max(SURE_ANSWER_TOKENS, 256)

# Words in the last user message that ask for a short answer (case-insensitive, whole words): an
# outline of several points is then the wrong answer, however list-like the question reads.
BREVITY_CUES = (
    r"(?:one|1|single|two|2)[ -]sentences?", r"in a sentence",
    r"in (?:a|one) word", r"one[ -]word", r"one[ -]liner?", r"in (?:a )?few words",
    r"in (?:\d+|a few|few|ten|five) words or (?:less|fewer)",
    r"brief(?:ly)?", r"concise(?:ly)?", r"succinct(?:ly)?", r"tl;?dr", r"in short",
    r"short (?:answer|reply|response|version)", r"(?:keep it|be|answer|reply) (?:short|brief|concise)",
    r"quick (?:answer|reply)", r"yes or no", r"yes/no", r"just (?:the|a) (?:answer|number|name|word)",
)
_BREVITY = re.compile(r"\b(?:" + "|".join(BREVITY_CUES) + r")\b", re.IGNORECASE)


class Router(Protocol):
    threshold: float

    def probability(self, text: str) -> float: ...


@dataclass(frozen=True)
class OutlineDecision:
    """``use``: write an outline; ``reason``: a short code (counted, logged); ``detail``: for people."""

    use: bool
    reason: str
    detail: str = ""


def brevity_cue(text: str) -> str | None:
    """The words in ``text`` that ask for a short answer, if any."""
    m = _BREVITY.search(text)
    return m.group(0) if m else None


def decide(mode: str, messages: list[dict[str, Any]] | None, max_tokens: int, router: Router, *,
           gave_way_to: Mode | None = None) -> OutlineDecision:
    """Outline mode for one request, or why not; raises :class:`BadEngineRequest` for an impossible "on".

    ``gave_way_to``: the mode the outline gave way to in :mod:`meshd.engine.modes` (structured
    output, penalties or tools: every token is shaped, or a call is expected; an "on" that clashes
    with one was refused there). Reason codes: ``asked`` / ``router`` (used); ``off``,
    ``not_chat``, ``shaped``, ``budget``, ``brevity``, ``router`` (declined).
    """
    if mode == "off":
        return OutlineDecision(False, "off")
    last = messages[-1] if messages else None
    if not (isinstance(last, dict) and last.get("role") == "user" and isinstance(last.get("content"), str)):
        if mode == "on":
            raise BadEngineRequest("outline decoding needs a plain chat question as the last message")
        return OutlineDecision(False, "not_chat", "the last message is not a plain user question")
    if gave_way_to is not None:
        return OutlineDecision(False, "shaped", f"the request has {gave_way_to.value}")
    if mode == "on":
        if max_tokens < MIN_ANSWER_TOKENS:
            raise BadEngineRequest(f"outline decoding needs max_tokens of at least {MIN_ANSWER_TOKENS} "
                                   f"({MIN_POINTS} points of a header and {MIN_POINT_TOKENS} tokens each); "
                                   f"this request allows {max_tokens}")
        return OutlineDecision(True, "asked")
    if max_tokens < PAYING_ANSWER_TOKENS:
        return OutlineDecision(False, "budget", f"{max_tokens} tokens leave an outline too little to win back "
                                                f"its time to first token (auto needs {PAYING_ANSWER_TOKENS})")
    cue = brevity_cue(last["content"])
    if cue is not None:
        return OutlineDecision(False, "brevity", f"the question asks for a short answer ({cue!r})")
    p = router.probability(last["content"])
    if p < router.threshold:
        return OutlineDecision(False, "router", f"router score {p:.2f} < {router.threshold:.2f}")
    return OutlineDecision(True, "router", f"router score {p:.2f} >= {router.threshold:.2f}")
