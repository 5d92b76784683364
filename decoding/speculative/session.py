"""One request's speculation: which candidates to send next, and what came of them.

Shared by the single-device generator and the mesh coordinator, so both pick
the same drafts for the same text. Candidates from every active drafter are
pooled with an estimated acceptance value each (a lookup continuation at
depth d: α^d; a Medusa path: the product of its heads' measured accuracies),
sorted best first — a prefix is never worth less than its extension, so the
order keeps parents before children — and merged into one token tree. The
adaptive controller then decides how many of them this round carries (maybe
none: a plain decode step).

Under a grammar (a tool call, structured output) the session holds a mirror of
the last stage's grammar, fed the same committed tokens. Where the grammar forces
text (``arguments`` once a tool is chosen) its forced tokens lead every candidate;
lookup continues after them (entity names are copied from the prompt), and every
candidate is cut at the first token the grammar refuses, so a round carries no row
that could not be taken. The last stage still masks every
row it verifies: the mirror only drafts, it never decides.
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
FORCED_VALUE = 0.95  # a grammar's forced tokens: taken unless the model writes the text in other tokens
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
    grammar: object | None = None  # a mirror of the last stage's constraint (decoding.constrained), fed here
    eos_ids: tuple[int, ...] = ()  # the grammar is not fed these (nor anything after them)
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
        self._prompt_len = len(self.context)
        self._fed_end = False  # the grammar saw the end of the answer: it takes nothing more
        self._forced_nodes: frozenset[int] = frozenset()
        self.steps = 0  # verify rounds and plain steps through the model after the first token
        self.forced_drafted = 0
        self.forced_accepted = 0

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

    def follow_grammar(self, grammar, eos_ids: Sequence[int]) -> None:
        """Draft under ``grammar``, a fresh constraint built from the same spec as the last stage's
        (it is fed the tokens generated so far, then every committed one)."""
        self.grammar, self.eos_ids, self._fed_end = grammar, tuple(int(t) for t in eos_ids), False
        self._feed(self.context[self._prompt_len:])

    def resync(self, context: Sequence[int]) -> None:
        """Start again from exactly ``context`` (a replay re-prefilled prompt + generated)."""
        if list(context) != self.context:
            self.context = list(context)
            if self.lookup is not None:
                self.lookup = LookupDrafter(self.context)
            if self.grammar is not None:
                self.grammar.restart()
                self._fed_end = False
                self._feed(self.context[self._prompt_len:])

    def next_tree(self, medusa: MedusaProposal | None = None) -> DraftTree:
        """The tree for the next verify round, rooted at the last committed token."""
        root = self.context[-1]
        pool: list[tuple[float, int, list[int]]] = []  # (value, -length, sequence)
        cap = self.max_candidates if self.fixed is None else min(self.fixed, self.max_candidates)
        forced = self.grammar.forced_draft(cap) if self._drafts_under_grammar else []
        pool += [(FORCED_VALUE ** d, -d, forced[:d]) for d in range(1, len(forced) + 1)]
        if self.lookup is not None:
            for b, seq in enumerate(self.lookup.propose(min(LOOKUP_LENGTH, cap), after=forced)):
                w = (1.0 if b == 0 else SECOND_BRANCH) * (FORCED_VALUE ** len(forced))
                seq = (forced + seq)[:self._valid(forced + seq)][len(forced):]
                pool += [(w * LOOKUP_ALPHA ** d, -len(forced) - d, forced + seq[:d]) for d in range(1, len(seq) + 1)]
        if medusa is not None and self.uses_medusa:
            cut = [s[:self._valid(s)] for s in medusa.sequences]
            pool += [(v, -len(s), s) for s, v in zip(cut, medusa.values)]
        if self.model_drafter is not None:
            chain = self.model_drafter.propose(self.context, min(cap, 6))
            chain = chain[:self._valid(chain)]
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
        tree = tree.truncated(n)
        self._forced_nodes = frozenset(_chain_nodes(tree, forced))
        return tree

    @property
    def _drafts_under_grammar(self) -> bool:
        return self.grammar is not None and not self._fed_end

    def _valid(self, seq: list[int]) -> int:
        """How much of ``seq`` (after the root) the grammar takes: drafts are cut there."""
        return self.grammar.valid_prefix(seq) if self._drafts_under_grammar and seq else len(seq)

    def draft_ahead(self, tree: DraftTree) -> None:
        """A draft model drafts the next round while ``tree`` is verified (idle time otherwise)."""
        if self.model_drafter is None or not tree.num_candidates:
            return
        branch = tree.tokens_of(tree.path_to(_first_leaf(tree)))[1:]
        self.model_drafter.draft_ahead(self.context, branch, min(self.max_candidates, 6))

    def commit(self, tree: DraftTree, verdict: Verdict) -> list[int]:
        """Record a verified round; returns the tokens it committed."""
        toks = verdict.committed(tree)
        self.steps += 1
        if tree.num_candidates:
            self.rounds += 1
            self.drafted += tree.num_candidates
            self.accepted += verdict.accepted
            self.forced_drafted += sum(1 for k in self._forced_nodes if k < tree.size)
            self.forced_accepted += len(self._forced_nodes.intersection(verdict.path))
            self.controller.observe(self._predicted, verdict.accepted)
        self.extend(toks)
        return toks

    def extend(self, tokens: Sequence[int]) -> None:
        self.context.extend(tokens)
        if self.lookup is not None:
            self.lookup.extend(tokens)
        if self.grammar is not None:
            self._feed(tokens)

    def _feed(self, tokens: Sequence[int]) -> None:
        """The mirror takes what the last stage's grammar took: every token up to the end of the answer."""
        from decoding.constrained import ConstraintViolated

        for t in tokens:
            if self._fed_end or t in self.eos_ids:
                self._fed_end = True
                return
            try:
                self.grammar.advance(int(t))
            except ConstraintViolated as exc:  # cannot happen while the two agree; drafting stops, not the answer
                self._fed_end = True
                self.fallback_reason = self.fallback_reason or f"grammar mirror refused a token: {exc}"
                return
            if self.grammar.is_finished():
                self._fed_end = True
                return

    def stats(self) -> SpeculativeStats:
        generated = len(self.context) - self._prompt_len
        return SpeculativeStats(drafter=self.drafter, rounds=self.rounds, drafted=self.drafted,
                                accepted=self.accepted, fallback_reason=self.fallback_reason,
                                constrained=self.grammar is not None, forced_drafted=self.forced_drafted,
                                forced_accepted=self.forced_accepted,
                                steps=self.steps + (1 if generated else 0), tokens=generated)


def _chain_nodes(tree: DraftTree, tokens: Sequence[int]) -> list[int]:
    """The nodes along ``tokens`` from the root, as far as the tree holds them."""
    node, out = 0, []
    for t in tokens:
        node = next((k for k in tree.children(node) if tree.tokens[k] == t), None)
        if node is None:
            break
        out.append(node)
    return out


def _first_leaf(tree: DraftTree) -> int:
    """The end of the tree's first branch (each node's first child, down to a leaf)."""
    node = 0
    while True:
        kids = tree.children(node)
        if not kids:
            return node
        node = kids[0]
