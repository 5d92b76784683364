"""What trained Medusa heads are worth: per-head accuracy on held-out answers and replayed acceptance."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from decoding.medusa import MedusaHeads, build_tree, chain_tree, expected_accepted
from decoding.training.medusa_data import IGNORE, HiddenSet

RANKS = 10  # per-head ranks whose accuracy is measured (the tree uses at most these)


@torch.inference_mode()
def ranked_predictions(heads: MedusaHeads, data: HiddenSet, lm_head: torch.Tensor,
                       ranks: int = RANKS, chunk: int = 256) -> torch.Tensor:
    """[N, K, ranks] token ids: each head's top-``ranks`` guesses at each position (full vocabulary)."""
    out = []
    for s in range(0, len(data), chunk):
        logits = heads.head_logits(data.hidden[s:s + chunk], lm_head)
        out.append(torch.topk(logits, ranks, dim=-1).indices)
    return torch.cat(out) if out else torch.zeros(0, heads.num_heads, ranks, dtype=torch.long)


def rank_accuracy(top: torch.Tensor, targets: torch.Tensor) -> list[list[float]]:
    """acc[k][i]: fraction of positions where head k's i-th ranked token is the right one."""
    acc = []
    for k in range(targets.shape[1]):
        valid = targets[:, k] != IGNORE
        n = int(valid.sum())
        hits = (top[valid, k, :] == targets[valid, k].unsqueeze(1)).float()
        acc.append([float(x) for x in (hits.sum(0) / max(1, n))])
    return acc


def simulate_greedy(top: torch.Tensor, data: HiddenSet, tree: Sequence[Sequence[int]]) -> dict:
    """Replay greedy verification on the held-out answers: how many candidates each round accepts.

    A round at position t sends the root x[t+1] plus the tree's candidates
    (head d's ranked tokens); a node is accepted when its whole path matches the
    model's own greedy continuation. The round commits the root plus the
    deepest accepted path, so the next round starts at t + 1 + accepted.
    Rounds run while at least one candidate position is left in the answer.
    """
    paths = [tuple(p) for p in tree]
    rounds = accepted = 0
    hist: dict[int, int] = {}
    for start, end in data.spans:
        t = start
        while t < end:
            tgt = data.targets[t]
            ok: dict[tuple[int, ...], bool] = {}
            best = 0
            for p in paths:
                d = len(p) - 1
                good = (d == 0 or ok.get(p[:-1], False)) and int(tgt[d]) != IGNORE \
                    and int(top[t, d, p[-1]]) == int(tgt[d])
                ok[p] = good
                if good:
                    best = max(best, len(p))
            rounds += 1
            accepted += best
            hist[best] = hist.get(best, 0) + 1
            t += 1 + best
    return {"rounds": rounds, "mean_accepted": accepted / rounds if rounds else 0.0,
            "tokens_per_round": (accepted + rounds) / rounds if rounds else 0.0,
            "accepted_histogram": {str(k): v for k, v in sorted(hist.items())}}


def evaluate(heads: MedusaHeads, data: HiddenSet, lm_head: torch.Tensor, max_nodes: int = 64,
             shipped_tree: Sequence[Sequence[int]] | None = None) -> dict:
    """Per-head accuracy on held-out positions, the tree built from it, and simulated acceptance.

    The built tree is chosen from these same positions' accuracies (50 numbers),
    so its replay is slightly optimistic; ``shipped_tree`` (the heads file's
    own tree, chosen at training time) is replayed too when given.
    """
    top = ranked_predictions(heads, data, lm_head)
    acc = rank_accuracy(top, data.targets)
    tree = build_tree(acc, max_nodes=max_nodes)
    chain = chain_tree(heads.num_heads)
    extra = {}
    if shipped_tree is not None:
        extra["shipped_tree"] = {"nodes": len(shipped_tree),
                                 "predicted_accepted": round(expected_accepted(shipped_tree, acc), 3),
                                 **simulate_greedy(top, data, shipped_tree)}
    return {**extra,
        "positions": len(data),
        "top1": [round(a[0], 4) for a in acc],
        "top5": [round(sum(a[:5]), 4) for a in acc],
        "topk_accuracy": [[round(x, 4) for x in a] for a in acc],
        "tree": [list(p) for p in tree],
        "tree_nodes": len(tree),
        "chain": {"nodes": len(chain), "predicted_accepted": round(expected_accepted(chain, acc), 3),
                  **simulate_greedy(top, data, chain)},
        "built_tree": {"nodes": len(tree), "predicted_accepted": round(expected_accepted(tree, acc), 3),
                       **simulate_greedy(top, data, tree)},
    }


__all__ = ["RANKS", "evaluate", "rank_accuracy", "ranked_predictions", "simulate_greedy"]
