"""Which decoding modes one answer combines: the one table, and the rule that reads it.

A request can ask for several ways of decoding at once: a grammar or penalties shaping
every token, offered tools, speculative decoding (Medusa heads, prompt lookup or a draft
model draft; the engine verifies), an outline answered point by point, a paired cloud
verifier, early exits. Some pairs cannot run together (an early exit changes the
distribution a verifier checks; an outline's points are free text), and which one gives way used to be
decided by ifs in three places. :data:`RULES` is now the only place: the engine builds
each mode's :class:`Ask` from the request and its own state (is a verifier paired, does
a serving route check exits) and :func:`resolve` says which modes run.

How a pair is read. A mode asked for explicitly (:attr:`Ask.ON`) beats one on by default
(:attr:`Ask.AUTO`), and two explicit ones that cannot combine are refused with a clear
error rather than one silently dropped; between two defaults, ``first`` runs. A grammar,
penalties and offered tools are always explicit (they are part of what was asked). A
rule with ``always`` lets ``first`` run whatever was asked, without an error: a paired
verifier's answer is the big model's own, drafted and checked its own way.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from meshd.engine.errors import BadEngineRequest


class Mode(enum.Enum):
    SHAPED = "structured output or repetition penalties"
    TOOLS = "tools"
    SPECULATIVE = 'speculative decoding "on"'
    OUTLINE = 'outline decoding "on"'
    CLOUD = "a cloud budget"
    EXITS = "early exits (exit_threshold)"


class Ask(enum.Enum):
    OFF = "off"  # not asked for, or not possible here (a verifier not paired, no route checks exits)
    AUTO = "auto"  # on by default: it steps aside for what it cannot combine with
    ON = "on"  # asked for explicitly: it runs, or the request is refused


#: Part of what was asked, never a default: any ask of these is :attr:`Ask.ON`.
REQUIRED = frozenset({Mode.SHAPED, Mode.TOOLS})

#: How to do without a mode asked for explicitly, for the refusal's message.
DROP = {Mode.SPECULATIVE: 'use speculative "auto" or "off"', Mode.OUTLINE: 'send outline "auto" or "off"',
        Mode.CLOUD: 'send cloud "auto" or "off"', Mode.EXITS: "send exit_threshold 0"}


@dataclass(frozen=True)
class Rule:
    first: Mode  # runs when both are on by default (see the module docstring)
    why: str  # why the pair cannot run together
    always: bool = False  # ``first`` runs whatever was asked; the other is dropped without an error


def _pair(a: Mode, b: Mode) -> frozenset[Mode]:
    return frozenset((a, b))


_SHAPES = "a grammar or penalties shape every token"
_LOSSY = "early exits change the model's distribution"
_BIG = "a paired verifier's answer is the big model's, drafted and checked its own way"

#: Every pair of modes that cannot run together, and who gives way. A pair not listed combines
#: (an outline's points speculate; tools answered in free text may speculate, exit early or be
#: verified; a tool grammar is itself SHAPED; a grammar or penalties speculate: the last stage
#: verifies each round with the sequence's own selector, ``decoding.speculative.verify_shaped``).
RULES: dict[frozenset[Mode], Rule] = {
    _pair(Mode.SHAPED, Mode.EXITS): Rule(Mode.SHAPED, f"{_SHAPES}; {_LOSSY}"),
    _pair(Mode.SHAPED, Mode.CLOUD): Rule(Mode.SHAPED, f"{_SHAPES}; the verifier samples without them"),
    _pair(Mode.SHAPED, Mode.OUTLINE): Rule(Mode.SHAPED, f"{_SHAPES}; an outline's points are free text"),
    _pair(Mode.TOOLS, Mode.OUTLINE): Rule(Mode.TOOLS, "a call may come, and an outline's points are free text"),
    _pair(Mode.EXITS, Mode.SPECULATIVE): Rule(Mode.EXITS, f"{_LOSSY}; a verify round needs all of it"),
    _pair(Mode.EXITS, Mode.OUTLINE): Rule(Mode.EXITS, f"{_LOSSY}; an outline's expansions need all of it"),
    _pair(Mode.CLOUD, Mode.EXITS): Rule(Mode.CLOUD, f"{_LOSSY}; {_BIG}"),
    _pair(Mode.CLOUD, Mode.OUTLINE): Rule(Mode.CLOUD, _BIG, always=True),
    _pair(Mode.CLOUD, Mode.SPECULATIVE): Rule(Mode.CLOUD, _BIG, always=True),
}


class ModesClash(BadEngineRequest):
    """Two modes asked for explicitly cannot run together (a 400 naming both and how to drop one)."""

    def __init__(self, a: Mode, b: Mode, rule: Rule):
        fixes = " or ".join(DROP[m] for m in (a, b) if m in DROP)
        super().__init__(f"{a.value} cannot be combined with {b.value}: {rule.why}; {fixes}")
        self.modes = (a, b)


@dataclass(frozen=True)
class Resolution:
    """Which modes run, and for each one that gave way, the mode it gave way to."""

    runs: frozenset[Mode]
    gave_way: Mapping[Mode, Mode]


def beats(a: Mode, b: Mode, asks: Mapping[Mode, Ask]) -> bool:
    """Whether ``a`` makes ``b`` give way (both asked for); raises :class:`ModesClash` for two explicit ones."""
    rule = RULES.get(_pair(a, b))
    if rule is None:
        return False
    if rule.always:
        return rule.first is a
    mine, theirs = asks.get(a, Ask.OFF), asks.get(b, Ask.OFF)
    if mine is Ask.ON and theirs is Ask.ON:
        raise ModesClash(*((a, b) if rule.first is a else (b, a)), rule)
    if mine is not theirs:
        return mine is Ask.ON
    return rule.first is a


def resolve(asks: Mapping[Mode, Ask]) -> Resolution:
    """The modes that run: each asked for and not made to give way by one that runs.

    A mode that gives way makes nothing else give way (an outline "on" turns a default early
    exit off, and the speculation the exit would have turned off runs in the outline's points).
    Raises :class:`ModesClash` for any pair of explicit modes that cannot combine, whatever else runs.
    """
    asks = {m: Ask.ON if m in REQUIRED and a is not Ask.OFF else a for m, a in asks.items()}
    asked = [m for m in Mode if asks.get(m, Ask.OFF) is not Ask.OFF]
    for i, a in enumerate(asked):  # every explicit clash is an error, checked in Mode's order
        for b in asked[i + 1:]:
            beats(a, b, asks)
    left, runs, gave_way = list(asked), set(), {}
    while left:
        free = [m for m in left if not any(beats(o, m, asks) for o in left if o is not m)]
        assert free, f"the modes table has a cycle for {asks}"
        runs.update(free)
        left = [m for m in left if m not in free]
        for m in list(left):
            winner = next((r for r in free if beats(r, m, asks)), None)
            if winner is not None:
                gave_way[m] = winner
                left.remove(m)
    return Resolution(frozenset(runs), gave_way)
