"""Stand-ins for speculative decoding tests: heads that guess badly on purpose, and prompts."""

import torch


class MirrorHeads:
    """A stand-in for trained Medusa heads: every head guesses with the model's own LM head.

    Poor guesses on purpose — parity must hold whatever the heads propose.
    """

    num_heads = 3
    tree = [(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]
    meta = {"topk_accuracy": [[0.5, 0.2], [0.3, 0.1], [0.2]]}

    def head_logits(self, hidden, lm_head):
        base = torch.nn.functional.linear(hidden, lm_head)
        return torch.stack([base.roll(k, -1) for k in range(self.num_heads)])


PROMPTS = [list(range(7, 40)), [5, 6, 7, 8, 5, 6, 7, 8, 5, 6], list(range(60, 64)) * 5]
