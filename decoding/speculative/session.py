"""One request's speculation: which candidates to send next, and what came of them.

Shared by the single-device generator and the mesh coordinator, so both pick
the same drafts for the same text. Candidates from every active drafter are
pooled with an estimated acceptance value each (a lookup continuation at
depth d: α^d; a Medusa path: the product of its heads' measured accuracies),
sorted best first — a prefix is never worth less than its extension, so the
order keeps parents before children — and merged into one token tree. The
adaptive controller then decides how many of them this round carries (maybe
none: a plain decode step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from decoding.speculative.adaptive import Controller, RoundCost
from decoding.speculative.lookup import LookupDrafter
from decoding.speculative.params import SpeculativeStats
from decoding.speculative.tree import DraftTree
from decoding.speculative.verify import Verdict

LOOKUP_ALPHA = 0.6  # prior chance that a lookup continuation's next token is right
LOOKUP_LENGTH = 8
SECOND_BRANCH = 0.3  # weight of a lookup branch other than the most recent match


@dataclass
class MedusaProposal:
    """What the last stage's heads proposed after the last accepted token."""

    sequences: list[list[int]]  # one per tree path, best first
    values: list[float]  # each path's estimated acceptance


@dataclass
class SpeculationSession:
    drafter: str  # "lookup", "medusa", "auto" (medusa + lookup), "draft_model"
    context: list[int]  # prompt + committed tokens, the last one being the next root
    cost: RoundCost = field(default_factory=RoundCost)
    max_candidates: int = 64
    fixed: int | None = None
    model_drafter: object | None = None  # a ModelDrafter for drafter "draft_model"
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    fallback_reason: str | None = None

    def __post_init__(self):
        self.lookup = LookupDrafter(self.context) if self.drafter in ("lookup", "auto") else None
        self.controller = Controller(self.cost, self.max_candidates, self.fixed)
        self._alpha_model = 0.8
        self._predicted = 0.0
        self._medusa_off = False

    @property
    def uses_medusa(self) -> bool:
        return self.drafter in ("medusa", "auto") and not self._medusa_off

    @property
    def wants_medusa(self) -> bool:
        """Ask for head proposals with this round only if the next round may use them.

        The heads cost the last stage an LM-head product per head and round, about as
        much as a decode step's own head on a small model; when the controller has
        stopped speculating (nothing pays), that is pure loss. It asks again just
        before each probe, so speculation can come back when the text turns predictable.
        """
        if not self.uses_medusa:
            return False
        c = self.controller
        return c.fixed is not None or c.last_choice > 0 or c.probing_next

    def drop_medusa(self, reason: str) -> None:
        """The heads are unavailable: go on with the other drafters (or plain decoding)."""
        self._medusa_off = True
        self.fallback_reason = self.fallback_reason or reason

    def resync(self, context: Sequence[int]) -> None:
        """Start again from exactly ``context`` (a replay re-prefilled prompt + generated)."""
        if list(context) != self.context:
            self.context = list(context)
            if self.lookup is not None:
                self.lookup = LookupDrafter(self.context)

    def next_tree(self, medusa: MedusaProposal | None = None) -> DraftTree:
        """The tree for the next verify round, rooted at the last committed token."""
        root = self.context[-1]
        pool: list[tuple[float, int, list[int]]] = []  # (value, -length, sequence)
        cap = self.max_candidates if self.fixed is None else min(self.fixed, self.max_candidates)
        if self.lookup is not None:
            for b, seq in enumerate(self.lookup.propose(min(LOOKUP_LENGTH, cap))):
                w = 1.0 if b == 0 else SECOND_BRANCH
                pool += [(w * LOOKUP_ALPHA ** d, -d, seq[:d]) for d in range(1, len(seq) + 1)]
        if medusa is not None and self.uses_medusa:
            pool += [(v, -len(s), s) for s, v in zip(medusa.sequences, medusa.values)]
        if self.model_drafter is not None:
            chain = self.model_drafter.propose(self.context, min(cap, 6))
            pool += [(self._alpha_model ** d, -d, chain[:d]) for d in range(1, len(chain) + 1)]
        pool.sort(key=lambda e: (-e[0], -e[1]))
        tree = DraftTree.root_only(root)
        values: list[float] = []
        for v, _, seq in pool:
            if not seq:
                continue
            before = tree.size
            tree = tree.extended([seq])
            values += [v] * (tree.size - before)
        n = self.controller.choose(values)
        self._predicted = sum(values[:n])
        return tree.truncated(n)

    def draft_ahead(self, tree: DraftTree) -> None:
        """A draft model drafts the next round while ``tree`` is verified (idle time otherwise)."""
        if self.model_drafter is None or not tree.num_candidates:
            return
        branch = tree.tokens_of(tree.path_to(_first_leaf(tree)))[1:]
        self.model_drafter.draft_ahead(self.context, branch, min(self.max_candidates, 6))

    def commit(self, tree: DraftTree, verdict: Verdict) -> list[int]:
        """Record a verified round; returns the tokens it committed."""
        toks = verdict.committed(tree)
        if tree.num_candidates:
            self.rounds += 1
            self.drafted += tree.num_candidates
            self.accepted += verdict.accepted
            self.controller.observe(self._predicted, verdict.accepted)
        self.extend(toks)
        return toks

    def extend(self, tokens: Sequence[int]) -> None:
        self.context.extend(tokens)
        if self.lookup is not None:
            self.lookup.extend(tokens)

    def stats(self) -> SpeculativeStats:
        return SpeculativeStats(drafter=self.drafter, rounds=self.rounds, drafted=self.drafted,
                                accepted=self.accepted, fallback_reason=self.fallback_reason)


def _first_leaf(tree: DraftTree) -> int:
    """The end of the tree's first branch (each node's first child, down to a leaf)."""
    node = 0
    while True:
        kids = tree.children(node)
        if not kids:
            return node
        node = kids[0]
