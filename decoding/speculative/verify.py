"""Deciding which drafted tokens the target model accepts, losslessly.

All drafters in meshd propose *deterministic* candidates (a lookup
continuation, the top-ranked tokens of Medusa heads, a draft model's greedy
path). For such drafts the exact speculative rejection rule — accept child x
with probability p(x)/q(x) where q is a point mass, and on rejection continue
with the renormalised residual p minus the rejected tokens — is the same, in
distribution, as *sampling the target's token at the node and following the
child that matches it*; with several children this is the recursive
(multi-draft) rejection of SpecInfer for point-mass drafts. We implement it in
the sample-and-match form because it spends exactly one uniform draw per
committed token, like plain decoding: seeded speculative output is then
token-identical to seeded plain output, not merely equal in distribution, and
a replay after a device left can skip draws by counting tokens.

A grammar or repetition penalties shape the target: the distribution at a node
depends on the tokens before it. :func:`verify_shaped` walks the same way with the
sequence's own selector choosing each node's token from its row, so the grammar and
the penalties see exactly the tokens plain decoding would have fed them, one draw
per committed token: greedy or seeded, it commits plain shaped decoding's tokens.

``verify_chain_rejection`` is the general rule for a drafter that samples from
its own distribution q (the edge–cloud verifier uses it). ``verify_typical``
is Medusa's typical acceptance: faster, but lossy — only on explicit opt-in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from decoding.sampling import SamplingParams, filtered_probs, inverse_cdf
from decoding.speculative.tree import DraftTree

Uniform = Callable[[], float]


@dataclass(frozen=True)
class Verdict:
    path: tuple[int, ...]  # accepted node indices, starting with the root (0)
    next_token: int  # the target's own token after the path (the next round's root)
    draws: int = 0  # uniform draws spent (== tokens committed, for sampled verification)

    @property
    def accepted(self) -> int:
        """Candidates accepted (the root and the next token not counted)."""
        return len(self.path) - 1

    def committed(self, tree: DraftTree) -> list[int]:
        """Tokens this round adds to the answer: accepted candidates, then the next token."""
        return [tree.tokens[i] for i in self.path[1:]] + [self.next_token]


def _walk(tree: DraftTree, pick: Callable[[int], int], last: Callable[[int], bool] | None = None) -> Verdict:
    """Follow the children whose token equals ``pick(node)``; stop where none does, or where
    ``last(token)`` says nothing may follow that token."""
    kids: dict[int, dict[int, int]] = {}
    for i in range(1, tree.size):
        kids.setdefault(tree.parents[i], {})[tree.tokens[i]] = i
    node, path, draws = 0, [0], 0
    while True:
        y = pick(node)
        draws += 1
        nxt = kids.get(node, {}).get(y)
        if nxt is None or (last is not None and last(y)):
            return Verdict(tuple(path), y, draws)
        path.append(nxt)
        node = nxt


def verify_greedy(tree: DraftTree, logits: torch.Tensor) -> Verdict:
    """logits: [tree.size, vocab], row i = the target's next-token logits after node i (a tensor, or rows
    computed when read: then only the walked ones are)."""
    if not isinstance(logits, torch.Tensor):
        return _walk(tree, lambda node: int(torch.argmax(logits[node])))
    best = torch.argmax(logits, dim=-1).tolist()
    return _walk(tree, lambda node: best[node])


def verify_sampled(tree: DraftTree, logits: torch.Tensor, params: SamplingParams, uniform: Uniform) -> Verdict:
    """Lossless verification of deterministic drafts under temperature / top-k / top-p."""
    if params.greedy:
        return verify_greedy(tree, logits)
    return _walk(tree, lambda node: inverse_cdf(filtered_probs(logits[node], params), uniform()))


def verify_shaped(tree: DraftTree, logits: torch.Tensor, choose: Callable[[torch.Tensor], int],
                  last: Callable[[int], bool]) -> Verdict:
    """Verification of a grammar- or penalty-shaped sequence: ``choose(row)`` is its selector
    (shape, draw, and move its state past the token), called only along the accepted path and
    once for the token after it. ``last(token)``: the answer ends with that token (an end of
    sequence, or a grammar now complete), so no candidate after it is taken and the selector
    is never asked about a token past the end."""
    return _walk(tree, lambda node: choose(logits[node]), last)


def verify_typical(tree: DraftTree, logits: torch.Tensor, params: SamplingParams, uniform: Uniform,
                   epsilon: float = 0.09, delta: float = 0.3) -> Verdict:
    """Medusa's typical acceptance (LOSSY): accept a child whose target probability clears
    min(epsilon, delta * exp(-entropy)); among several, the most probable. The token after the
    path is sampled from the target (one draw)."""
    if params.greedy:
        return verify_greedy(tree, logits)
    kids: dict[int, list[int]] = {}
    for i in range(1, tree.size):
        kids.setdefault(tree.parents[i], []).append(i)
    node, path = 0, [0]
    while True:
        probs = filtered_probs(logits[node], params)
        ent = float(-(probs * torch.log(probs.clamp_min(1e-30))).sum())
        threshold = min(epsilon, delta * math.exp(-ent))
        ok = [(float(probs[tree.tokens[c]]), c) for c in kids.get(node, []) if probs[tree.tokens[c]] > threshold]
        if not ok:
            return Verdict(tuple(path), inverse_cdf(probs, uniform()), 1)
        node = max(ok)[1]
        path.append(node)


def verify_chain_rejection(tree: DraftTree, logits: torch.Tensor, draft_probs: torch.Tensor,
                           params: SamplingParams, uniform: Uniform) -> Verdict:
    """Leviathan/Chen rejection sampling for a chain drafted by sampling q.

    draft_probs: [num_candidates, vocab], row i = q for candidate i+1 (after the same
    temperature/top-k/top-p as the target). Accept x with probability min(1, p(x)/q(x));
    at the first rejection sample from norm(max(0, p - q)); if all pass, sample from p.
    """
    if not tree.is_chain:
        raise ValueError("rejection sampling with a draft distribution needs a chain")
    if params.greedy:
        return verify_greedy(tree, logits)
    path, draws = [0], 0
    for i in range(1, tree.size):
        p = filtered_probs(logits[i - 1], params)
        q = draft_probs[i - 1].double()
        x = tree.tokens[i]
        draws += 1
        qx = float(q[x])
        if qx > 0 and uniform() < min(1.0, float(p[x]) / qx):
            path.append(i)
            continue
        residual = (p.double() - q).clamp_min(0)
        if float(residual.sum()) <= 0:  # p == q: any rejection is measure-zero; fall back to p
            residual = p.double()
        draws += 1
        return Verdict(tuple(path), inverse_cdf(residual / residual.sum(), uniform()), draws)
    draws += 1
    return Verdict(tuple(path), inverse_cdf(filtered_probs(logits[tree.size - 1], params), uniform()), draws)


def dense_draft_probs(support: Sequence[tuple[Sequence[int], Sequence[float]]], vocab: int) -> torch.Tensor:
    """[drafts, vocab] from per-draft (ids, probs) on the sampler's support (the rest is 0).

    Refuses what a hostile sender could use to bend the verdict: ids out of range,
    repeated ids, negative or non-finite probabilities, rows not summing to ~1.
    """
    out = torch.zeros(len(support), vocab, dtype=torch.float64, device="cpu")  # sampling is on the host
    for r, (ids, probs) in enumerate(support):
        if len(ids) != len(probs) or not ids:
            raise ValueError(f"draft {r}: {len(ids)} ids but {len(probs)} probabilities")
        if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"draft {r}: token ids must be distinct and in [0, {vocab})")
        p = torch.tensor(list(probs), dtype=torch.float64, device="cpu")
        if not bool(torch.isfinite(p).all()) or bool((p < 0).any()) or abs(float(p.sum()) - 1.0) > 1e-3:
            raise ValueError(f"draft {r}: probabilities must be finite, non-negative and sum to 1")
        out[r, torch.tensor(list(ids), device="cpu")] = p
    return out


def verify_offloaded(drafts: Sequence[int], root: int, logits: torch.Tensor, params: SamplingParams,
                     uniform: Uniform, support=None) -> Verdict:
    """A cloud verifier's verdict on a home's drafted chain (logits: root's row first).

    Greedy: argmax matching, so committed tokens are the target's own greedy ones.
    With the drafter's distribution (``support``: per draft (ids, probs)): rejection
    sampling. Without it: the drafts are candidates, the target samples each
    position and accepts a matching draft. All three keep the target's law.
    """
    tree = DraftTree.chain(root, list(drafts))
    if params.greedy:
        return verify_greedy(tree, logits)
    if support is None:
        return verify_sampled(tree, logits, params, uniform)
    return verify_chain_rejection(tree, logits, dense_draft_probs(support, logits.shape[-1]), params, uniform)
