"""Medusa self-drafting heads: K small residual blocks on the model's final hidden state.

Why this shape: the last stage already holds the final-normed hidden state of
the last accepted token (the verify pass computed it), so K heads that each
add one residual block before the model's *own* LM head can guess tokens
t+2 … t+K+1 for the price of K tiny matmuls and K LM-head rows — no second
model, no extra pass through the pipeline. Sharing the LM head keeps the file
small (a few MB: the residual blocks only) and ties the heads to exactly one
model, which is why the file records the model's identity and ``load`` checks
hidden size and vocabulary against the model it is paired with.

W1 (and b1) start at zero, so an untrained head equals the LM head: training
(``decoding.training.medusa``) moves each head from "next token" towards "k+2
tokens ahead" instead of starting from noise.

The file holds plain tensors, ints, strings and lists only and is read with
``torch.load(weights_only=True)``: a heads file from elsewhere can never run
code. A sha256 pin (``meshd.model.heads``) guards the shipped one.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from decoding.errors import DrafterError
from decoding.linear import linear
from decoding.heads_file import read_heads_file, write_heads_file

FORMAT = "meshd-medusa-heads"
FORMAT_VERSION = 1
DEFAULT_NUM_HEADS = 5
MAX_TREE_NODES = 64


def chain_tree(num_heads: int) -> list[tuple[int, ...]]:
    """Top-1 of every head, one after the other: the K-candidate chain Jupiter evaluated."""
    return [(0,) * d for d in range(1, num_heads + 1)]


def build_tree(topk_accuracy: Sequence[Sequence[float]], max_nodes: int = MAX_TREE_NODES) -> list[tuple[int, ...]]:
    """The sparse candidate tree with the largest expected number of accepted tokens.

    ``topk_accuracy[k][i]`` is the measured chance that head k's i-th ranked
    token is the right one. Treating the heads as independent, a node is
    accepted with the product of its path's accuracies, and the expected
    accepted length is the sum over nodes. A child never beats its parent
    (accuracies are <= 1), so taking the best frontier node each time yields the
    top-``max_nodes`` paths: prefix-closed and optimal. Paths come out in the
    order they were chosen — parents first and best first — so any prefix of the
    list is itself the best tree of that size (the verifier may shorten it).
    Nodes that can never be accepted (value 0) are not added.
    """
    if max_nodes < 0:
        raise ValueError("max_nodes must be >= 0")
    acc = [[float(a) for a in row] for row in topk_accuracy]
    for k, row in enumerate(acc):
        if any(not 0.0 <= a <= 1.0 for a in row):
            raise ValueError(f"topk_accuracy[{k}] must hold probabilities in [0, 1]")
    if not acc or not acc[0]:
        return []
    # Max-heap on value; ties broken by (shorter, lexicographically smaller) path for determinism.
    frontier: list[tuple[float, int, tuple[int, ...]]] = []

    def push(path: tuple[int, ...], value: float) -> None:
        heapq.heappush(frontier, (-value, len(path), path))

    for i, a in enumerate(acc[0]):
        push((i,), a)
    tree: list[tuple[int, ...]] = []
    while frontier and len(tree) < max_nodes:
        neg, _, path = heapq.heappop(frontier)
        value = -neg
        if value <= 0.0:
            break
        tree.append(path)
        depth = len(path)
        if depth < len(acc):
            for i, a in enumerate(acc[depth]):
                push(path + (i,), value * a)
    return tree


def tree_parents(paths: Sequence[Sequence[int]]) -> list[int]:
    """Each node's parent index (-1: child of the root), for ``decoding.masks.tree_mask_from_parents``."""
    index: dict[tuple[int, ...], int] = {}
    parents = []
    for i, p in enumerate(paths):
        p = tuple(int(x) for x in p)
        if not p or any(x < 0 for x in p):
            raise ValueError(f"tree node {i}: a path must be a non-empty tuple of ranks >= 0, got {p}")
        if p in index:
            raise ValueError(f"tree node {i}: path {p} is listed twice")
        if len(p) == 1:
            parents.append(-1)
        else:
            parent = index.get(p[:-1])
            if parent is None:
                raise ValueError(f"tree node {i}: parent {p[:-1]} of {p} must be listed before it")
            parents.append(parent)
        index[p] = i
    return parents


def expected_accepted(paths: Sequence[Sequence[int]], topk_accuracy: Sequence[Sequence[float]]) -> float:
    """Expected accepted candidates per round under the independence model ``build_tree`` optimises."""
    total = 0.0
    for p in paths:
        v = 1.0
        for depth, rank in enumerate(p):
            row = topk_accuracy[depth] if depth < len(topk_accuracy) else ()
            v *= float(row[rank]) if rank < len(row) else 0.0
        total += v
    return total


class MedusaHeads(torch.nn.Module):
    """K residual blocks (x + SiLU(W1 x + b1)) whose outputs go through the model's own LM head."""

    def __init__(self, num_heads: int = DEFAULT_NUM_HEADS, hidden_size: int = 576,
                 tree: Sequence[Sequence[int]] | None = None, meta: dict | None = None):
        super().__init__()
        if num_heads < 1 or hidden_size < 1:
            raise ValueError("num_heads and hidden_size must be positive")
        self.num_heads = int(num_heads)
        self.hidden_size = int(hidden_size)
        self.w1 = torch.nn.Parameter(torch.zeros(num_heads, hidden_size, hidden_size))
        self.b1 = torch.nn.Parameter(torch.zeros(num_heads, hidden_size))
        self.tree: list[tuple[int, ...]] = [tuple(p) for p in (tree if tree is not None else chain_tree(num_heads))]
        self.meta: dict = dict(meta or {})

    @property
    def vocab_size(self) -> int | None:
        v = self.meta.get("vocab_size")
        return int(v) if v is not None else None

    # -- compute ------------------------------------------------------------------
    def residual(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """[n, d] -> [n, K, d]: each head's hidden state before the LM head (differentiable)."""
        k = self.num_heads if num_heads is None else num_heads
        x = hidden.to(self.w1.dtype)
        r = torch.einsum("nd,ked->nke", x, self.w1[:k]) + self.b1[:k]
        return x.unsqueeze(1) + F.silu(r)

    def head_logits(self, hidden: torch.Tensor, lm_head: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """Logits [K, V] (or [n, K, V]) of tokens t+2 … t+K+1 from the final-normed hidden at t.

        ``num_heads`` computes only the first heads (a shallower tree needs no
        deeper guesses; each head costs one LM-head row per position).
        """
        if num_heads is not None and not 1 <= num_heads <= self.num_heads:
            raise DrafterError(f"num_heads must be in [1, {self.num_heads}], got {num_heads}")
        if hidden.dim() not in (1, 2) or hidden.shape[-1] != self.hidden_size:
            raise DrafterError(
                f"Medusa heads expect final hidden states of size {self.hidden_size}, got shape {tuple(hidden.shape)}")
        if len(lm_head.shape) != 2 or lm_head.shape[1] != self.hidden_size:
            raise DrafterError(
                f"Medusa heads need an LM head [vocab, {self.hidden_size}], got shape {tuple(lm_head.shape)}")
        if self.vocab_size is not None and lm_head.shape[0] != self.vocab_size:
            raise DrafterError(
                f"Medusa heads were trained for a vocabulary of {self.vocab_size}; this LM head has {lm_head.shape[0]}")
        single = hidden.dim() == 1
        h = hidden.unsqueeze(0) if single else hidden
        y = self.residual(h.float(), num_heads)
        out = linear(y.to(lm_head.dtype), lm_head).float()  # dense or packed (decoding.linear)
        return out[0] if single else out

    # -- files --------------------------------------------------------------------
    def state_for_file(self, meta: dict) -> dict:
        return {
            "format": FORMAT, "version": FORMAT_VERSION,
            "num_heads": self.num_heads, "hidden_size": self.hidden_size,
            # fp16 halves the file; the blocks are small corrections where fp16 is plenty.
            "w1": self.w1.detach().to(torch.float16).contiguous(),
            "b1": self.b1.detach().to(torch.float16).contiguous(),
            "tree": [list(p) for p in self.tree],
            "meta_json": json.dumps(meta, sort_keys=True),
        }

    def save(self, path, meta: dict | None = None) -> str:
        """Write the heads atomically; returns the file's sha256 (pin it where the file ships)."""
        if meta is not None:
            self.meta = dict(meta)
        tree_parents(self.tree)  # never write a tree that load() would refuse
        return write_heads_file(path, self.state_for_file(self.meta))

    @classmethod
    def load(cls, path, *, sha256: str | None = None, vocab_size: int | None = None,
             hidden_size: int | None = None) -> "MedusaHeads":
        path, raw = read_heads_file(path, sha256, "Medusa heads")
        heads = cls._from_state(raw, path)
        heads.source = str(path)
        heads.check_model(vocab_size=vocab_size, hidden_size=hidden_size)
        return heads

    def check_model(self, *, vocab_size: int | None = None, hidden_size: int | None = None) -> None:
        """Refuse a model whose shapes differ from the one these heads were trained on."""
        where = getattr(self, "source", "Medusa heads")
        if hidden_size is not None and self.hidden_size != hidden_size:
            raise DrafterError(f"{where}: heads are for hidden size {self.hidden_size}, "
                               f"this model has {hidden_size} (heads belong to one model)")
        if vocab_size is not None and self.vocab_size is not None and self.vocab_size != vocab_size:
            raise DrafterError(f"{where}: heads are for a vocabulary of {self.vocab_size} tokens, "
                               f"this model has {vocab_size} (heads belong to one model)")

    @classmethod
    def _from_state(cls, raw, path: Path) -> "MedusaHeads":
        def bad(why: str) -> DrafterError:
            return DrafterError(f"{path}: not a valid Medusa heads file ({why})")

        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise bad("missing format tag")
        if raw.get("version") != FORMAT_VERSION:
            raise bad(f"format version {raw.get('version')!r}, this meshd reads {FORMAT_VERSION}")
        k, d = raw.get("num_heads"), raw.get("hidden_size")
        if not isinstance(k, int) or not isinstance(d, int) or k < 1 or d < 1:
            raise bad("num_heads/hidden_size missing")
        w1, b1 = raw.get("w1"), raw.get("b1")
        if not isinstance(w1, torch.Tensor) or tuple(w1.shape) != (k, d, d):
            raise bad(f"w1 must be [{k}, {d}, {d}]")
        if not isinstance(b1, torch.Tensor) or tuple(b1.shape) != (k, d):
            raise bad(f"b1 must be [{k}, {d}]")
        if not (torch.isfinite(w1).all() and torch.isfinite(b1).all()):
            raise bad("non-finite weights")
        try:
            meta = json.loads(raw.get("meta_json") or "{}")
            tree = [tuple(int(x) for x in p) for p in raw.get("tree") or []]
            tree_parents(tree)
        except (TypeError, ValueError) as exc:
            raise bad(str(exc)) from exc
        if not isinstance(meta, dict):
            raise bad("meta is not an object")
        if len(tree) > MAX_TREE_NODES or any(len(p) > k for p in tree):
            raise bad(f"tree must have <= {MAX_TREE_NODES} nodes of depth <= {k}")
        heads = cls(k, d, tree=tree or None, meta=meta)
        with torch.no_grad():
            heads.w1.copy_(w1.float())
            heads.b1.copy_(b1.float())
        heads.requires_grad_(False)
        heads.eval()
        return heads


__all__ = ["MedusaHeads", "chain_tree", "build_tree", "tree_parents", "expected_accepted",
           "DEFAULT_NUM_HEADS", "MAX_TREE_NODES"]
