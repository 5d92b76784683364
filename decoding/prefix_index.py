"""A radix tree over token ids: which held sequence starts with the longest part of a prompt.

Why a radix tree and not chained block hashes (vLLM's 16-token blocks):

- **Reuse to the exact token.** A block-hash cache reuses whole blocks only, so
  a Home Assistant turn whose prompt differs from the last one at token 2,531
  reuses 2,528. The tree matches to the token, and a stage's KV cache can fork
  a sequence at any position, so nothing forces a block granularity on us.
- **Exact keys, no collisions.** Edges hold the token ids themselves; a match
  is a comparison, never a hash that could alias two prompts.
- **Few, long entries.** A home holds tens of conversations that share one
  2–3.5k-token system prompt; the tree stores that prompt once, as one edge,
  and branches where conversations differ (a lookup is one pass over the
  prompt, whatever the number of entries).

Holders are opaque keys (a stage's sequence keys): every node records the
holders whose token ids pass through all of it, so any of them holds the KV
of any prefix ending in that node's edge.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

__all__ = ["PrefixIndex"]


class _Node:
    __slots__ = ("edge", "depth", "children", "holders", "parent")

    def __init__(self, edge: tuple[int, ...], depth: int, parent: "_Node | None"):
        self.edge = edge  # the token ids from the parent's end to this node's end
        self.depth = depth  # token ids from the root to this node's end
        self.children: dict[int, _Node] = {}  # keyed by the first token of the child's edge
        self.holders: set = set()  # holders whose ids run through this whole node
        self.parent = parent


class PrefixIndex:
    def __init__(self) -> None:
        self._root = _Node((), 0, None)
        self._paths: dict[Hashable, tuple[int, ...]] = {}  # holder -> the token ids it was inserted with

    def __len__(self) -> int:
        return len(self._paths)

    def __contains__(self, holder: Hashable) -> bool:
        return holder in self._paths

    def holders(self) -> list:
        return list(self._paths)

    def tokens_of(self, holder: Hashable) -> tuple[int, ...]:
        return self._paths[holder]

    def insert(self, holder: Hashable, ids: Sequence[int]) -> None:
        """Record that ``holder`` holds the KV of ``ids`` (replacing what it held before)."""
        self.remove(holder)
        ids = tuple(int(t) for t in ids)
        self._paths[holder] = ids
        node, i = self._root, 0
        while i < len(ids):
            child = node.children.get(ids[i])
            if child is None:
                child = _Node(ids[i:], len(ids), node)
                node.children[ids[i]] = child
                child.holders.add(holder)
                return
            n = _common(child.edge, ids, i)
            if n < len(child.edge):
                child = self._split(child, n)
            child.holders.add(holder)
            node, i = child, i + n

    def remove(self, holder: Hashable) -> None:
        """Forget ``holder``; nodes no holder runs through any more go with it."""
        ids = self._paths.pop(holder, None)
        if ids is None:
            return
        node, i = self._root, 0
        visited: list[_Node] = []
        while i < len(ids):
            node = node.children[ids[i]]
            visited.append(node)
            i += len(node.edge)
        for node in reversed(visited):
            node.holders.discard(holder)
            if not node.holders:
                del node.parent.children[node.edge[0]]
            elif len(node.children) == 1 and not (node.holders - next(iter(node.children.values())).holders):
                self._merge(node)

    def longest(self, ids: Sequence[int]) -> tuple[int, set]:
        """The longest prefix of ``ids`` some holder holds: (its length, the holders that hold it)."""
        ids = tuple(int(t) for t in ids)
        node, i, holders = self._root, 0, set()
        while i < len(ids):
            child = node.children.get(ids[i])
            if child is None:
                break
            n = _common(child.edge, ids, i)
            i, holders = i + n, child.holders
            if n < len(child.edge):
                break
            node = child
        return i, set(holders)

    # -- the tree's shape ----------------------------------------------------------------
    def _split(self, child: _Node, n: int) -> _Node:
        """Cut ``child``'s edge after ``n`` tokens; returns the new upper node."""
        parent = child.parent
        upper = _Node(child.edge[:n], child.depth - len(child.edge) + n, parent)
        upper.holders = set(child.holders)
        parent.children[upper.edge[0]] = upper
        child.edge, child.parent = child.edge[n:], upper
        upper.children[child.edge[0]] = child
        return upper

    def _merge(self, node: _Node) -> None:
        """Fold ``node``'s only child into it (no holder ends at ``node`` any more)."""
        (child,) = node.children.values()
        node.edge, node.depth = node.edge + child.edge, child.depth
        node.children = child.children
        for c in node.children.values():
            c.parent = node
        node.holders = child.holders


def _common(edge: tuple[int, ...], ids: Sequence[int], start: int) -> int:
    """How many leading tokens of ``edge`` equal ``ids[start:]``."""
    n = min(len(edge), len(ids) - start)
    if edge[:n] == tuple(ids[start:start + n]):  # the usual case, compared in C
        return n
    for k in range(n):
        if edge[k] != ids[start + k]:
            return k
    return n
