"""Attention masks for new tokens appended after ``past`` visible positions.

Boolean, True = may attend. Causal chunk masks let chunk i of a prompt attend to
chunks < i already in the cache; tree masks let one forward pass verify a whole
speculative token tree (each node sees the prefix and its own ancestors only).

Masks used inside the forward are built on the stage's device (``device=``, or
the device of the tree mask they extend). ``tree_mask_from_parents`` builds on
the host: it walks a Python list node by node, which on a GPU would be one tiny
kernel per node; the forward moves the finished mask once per message.
"""

from __future__ import annotations

import torch


def chunk_mask(past: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor | None:
    """Causal mask for n new tokens after ``past`` cached ones; None when no mask is needed."""
    if n == 1:
        return None
    i = torch.arange(n, device=device).unsqueeze(1)
    j = torch.arange(past + n, device=device).unsqueeze(0)
    return j <= past + i


def tree_mask_from_parents(parents: list[int]) -> torch.Tensor:
    """[n, n] ancestor mask of a token tree given each node's parent index (-1 = child of the prefix).

    Nodes must be listed parents-first (topological order).
    """
    n = len(parents)
    m = torch.zeros(n, n, dtype=torch.bool, device="cpu")
    for i, p in enumerate(parents):
        if p >= i:
            raise ValueError(f"tree node {i} lists parent {p}: parents must come first")
        if p >= 0:
            m[i] = m[p]
        m[i, i] = True
    return m


def tree_depths(tree: torch.Tensor) -> torch.Tensor:
    """Depth of each node (0 for children of the prefix): its ancestor count."""
    return tree.sum(dim=-1) - 1


def with_prefix(tree: torch.Tensor, past: int) -> torch.Tensor:
    """Extend an [n, n] tree mask to [n, past + n]: every node sees the whole prefix."""
    n = tree.shape[0]
    return torch.cat([torch.ones(n, past, dtype=torch.bool, device=tree.device), tree.bool()], dim=1)
