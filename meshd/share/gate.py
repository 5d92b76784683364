"""The leader's rule for plans and fetches: a plan waits until its members hold the layers it gives them.

Pure. The leader computes the plan it wants (the *candidate*); each stage of it
is either covered by what that member holds verified on disk, or that member
must fetch first. While someone must fetch:

- if the plan now in force still works (all its members are there and hold
  their ranges), it keeps serving, and the candidate is adopted once the
  fetches are done;
- otherwise (a member left, or there is no plan yet) the leader adopts the
  best plan the members can serve at once — over the members that need not
  fetch, else over those holding the whole file — and re-plans when the
  fetches are done;
- if nobody can serve at once, the candidate is adopted anyway: its members
  fetch their missing tensors before loading them (the stage deploy waits).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from meshd.share.manifest import block_of


@dataclass(frozen=True)
class Holdings:
    """What one member holds verified: everything, or whole layers plus some other tensors."""

    complete: bool = False
    layers: frozenset[int] = frozenset()
    tensors: frozenset[str] = frozenset()  # held tensors outside the blocks (token_embd.weight, ...)
    header: bool = False

    def covers(self, needed: Iterable[str]) -> bool:
        if self.complete:
            return True
        for name in needed:
            b = block_of(name)
            if (b not in self.layers) if b is not None else (name not in self.tensors):
                return False
        return True


NOTHING = Holdings()


def holdings_of(tensor_names: Iterable[str], held: Iterable[str], header: bool, complete: bool) -> Holdings:
    """Holdings from the names of all tensors of the file and of those held (whole layers only count)."""
    held = set(held)
    per_layer: dict[int, bool] = {}
    others = set()
    for name in tensor_names:
        b = block_of(name)
        if b is None:
            if name in held:
                others.add(name)
        else:
            per_layer[b] = per_layer.get(b, True) and name in held
    return Holdings(complete, frozenset(b for b, ok in per_layer.items() if ok), frozenset(others), header)


@dataclass(frozen=True)
class GateDecision:
    adopt: object | None  # the plan to adopt now; None: keep the current one
    waiting: dict[str, tuple[int, int]] = field(default_factory=dict)  # member -> range it must fetch first
    reason: str = ""


def gate_plan(candidate, current, members: Iterable[str], covers: Callable[[str, int, int], bool],
              plan_over: Callable[[list[str]], object], complete: Iterable[str]) -> GateDecision:
    """Decide what to adopt, given the ``candidate`` plan and what members hold.

    ``covers(node, first, end)``: the member holds what layers ``[first, end)`` need.
    ``plan_over(ids)``: the planner's plan over those members. ``complete``:
    members holding the whole file. Plans are anything with ``.stages`` of
    ``(node_id, first, end)`` and ``.num_layers``.
    """
    waiting = {s.node_id: (s.first, s.end) for s in candidate.stages if not covers(s.node_id, s.first, s.end)}
    if not waiting:
        return GateDecision(candidate)

    def servable(plan) -> bool:
        return plan is not None and plan.num_layers == candidate.num_layers and bool(plan.stages) and all(
            s.node_id in present and covers(s.node_id, s.first, s.end) for s in plan.stages)

    present = set(members)
    if servable(current):
        return GateDecision(None, waiting, "the current plan serves while members fetch their layers")
    for ids in ([m for m in sorted(present) if m not in waiting], sorted(present & set(complete))):
        if ids:
            alt = plan_over(ids)
            if servable(alt):
                return GateDecision(alt, waiting, "serving with the members that hold their layers "
                                                  "while others fetch")
    return GateDecision(candidate, waiting, "no member can serve at once: stages fetch before loading")
