"""The candidates one verify round sends through the model: a token tree under a root.

Node 0 is the *root*: the last committed token, not yet in any KV cache. Every
other node is a drafted candidate whose parent comes before it, so one forward
pass with an ancestor mask scores every branch at once, each node at position
``n + depth``. A chain (one candidate per depth) is the special case whose
mask is ordinary causal attention.

Trees are built as tries of drafted token sequences: drafters propose
sequences (a lookup continuation, a Medusa path), the trie merges common
prefixes, and the node order is the order of insertion — drafters insert their
most likely sequences first, so a prefix of the node list is the best smaller
tree (what the adaptive controller truncates to).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from decoding.masks import tree_mask_from_parents


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]
    parents: tuple[int, ...]  # parents[0] == -1; parents[i] < i

    def __post_init__(self):
        if not self.tokens or len(self.tokens) != len(self.parents) or self.parents[0] != -1:
            raise ValueError("a draft tree needs a root (parent -1) and one parent per node")
        if any(not 0 <= p < i for i, p in enumerate(self.parents) if i):
            raise ValueError("every non-root node's parent must come before it")

    # -- construction ---------------------------------------------------------------
    @classmethod
    def root_only(cls, root: int) -> "DraftTree":
        return cls((int(root),), (-1,))

    @classmethod
    def chain(cls, root: int, candidates: Sequence[int]) -> "DraftTree":
        toks = (int(root), *map(int, candidates))
        return cls(toks, tuple(range(-1, len(toks) - 1)))

    @classmethod
    def from_sequences(cls, root: int, sequences: Iterable[Sequence[int]], max_nodes: int | None = None
                       ) -> "DraftTree":
        """A trie of drafted continuations of ``root`` (most wanted first), capped at ``max_nodes`` candidates."""
        return cls.root_only(root).extended(sequences, max_nodes)

    def extended(self, sequences: Iterable[Sequence[int]], max_nodes: int | None = None) -> "DraftTree":
        """This tree plus more continuations of the root, merged into the trie."""
        tokens, parents = list(self.tokens), list(self.parents)
        index = {(parents[i], tokens[i]): i for i in range(1, len(tokens))}
        cap = None if max_nodes is None else max_nodes + 1
        for seq in sequences:
            node = 0
            for t in seq:
                if cap is not None and len(tokens) >= cap:
                    break
                key = (node, int(t))
                nxt = index.get(key)
                if nxt is None:
                    tokens.append(int(t))
                    parents.append(node)
                    nxt = index[key] = len(tokens) - 1
                node = nxt
        return DraftTree(tuple(tokens), tuple(parents))

    def truncated(self, max_candidates: int) -> "DraftTree":
        """The first ``max_candidates`` candidates (always a valid tree: parents come first)."""
        n = max(0, int(max_candidates)) + 1
        return self if n >= len(self.tokens) else DraftTree(self.tokens[:n], self.parents[:n])

    # -- queries --------------------------------------------------------------------
    @property
    def root(self) -> int:
        return self.tokens[0]

    @property
    def size(self) -> int:
        """Tokens sent through the model this round (root + candidates)."""
        return len(self.tokens)

    @property
    def num_candidates(self) -> int:
        return len(self.tokens) - 1

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def children(self, node: int) -> list[int]:
        return [i for i in range(node + 1, len(self.parents)) if self.parents[i] == node]

    def depth(self) -> int:
        d = [0] * len(self.parents)
        for i in range(1, len(d)):
            d[i] = d[self.parents[i]] + 1
        return max(d)

    def mask(self) -> torch.Tensor | None:
        """[m, m] ancestor mask for the forward; None for a chain (causal attention does it)."""
        return None if self.is_chain else tree_mask_from_parents(list(self.parents))

    def path_to(self, node: int) -> list[int]:
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def tokens_of(self, path: Sequence[int]) -> list[int]:
        return [self.tokens[i] for i in path]
