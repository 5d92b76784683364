"""Turn Medusa heads' predictions at one position into candidate sequences.

The last stage already holds the final-normed hidden state of the last
accepted token (the verify pass computed it), so proposing the next round
costs the heads' small residual blocks and one LM-head product — no extra
pass through the model. A tree path (i0, i1, …) means "the i0-th ranked token
of head 0, then the i1-th of head 1, …"; paths are listed parents first, best
first, so the first n paths are the best n-node tree.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def path_values(paths: Sequence[Sequence[int]], topk_accuracy: Sequence[Sequence[float]] | None) -> list[float]:
    """Each path's estimated chance of being accepted: the product of its ranks' accuracies."""
    out = []
    for p in paths:
        v = 1.0
        for depth, rank in enumerate(p):
            if topk_accuracy is None or depth >= len(topk_accuracy) or rank >= len(topk_accuracy[depth]):
                v *= 0.5 ** (depth + 1) / (rank + 1)
            else:
                v *= float(topk_accuracy[depth][rank])
        out.append(v)
    return out


@torch.inference_mode()
def propose_sequences(heads, hidden: torch.Tensor, lm_head: torch.Tensor,
                      paths: Sequence[Sequence[int]]) -> list[list[int]]:
    """Candidate token sequences (one per tree path, same order) from the heads at ``hidden`` [d]."""
    if not paths:
        return []
    depth = max(len(p) for p in paths)
    ranks = max(max(p) for p in paths) + 1
    logits = heads.head_logits(hidden, lm_head)[:depth]  # [depth, V]
    top = torch.topk(logits, ranks, dim=-1).indices.tolist()
    return [[top[d][r] for d, r in enumerate(p)] for p in paths]
