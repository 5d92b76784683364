"""Exit heads bound to one stage, and the check that lets a decode row leave.

The heads file (:mod:`decoding.exits.heads`) is the model's; a binding is one
stage's: only the exits inside its layers, with the LM head's shortlisted rows
and every exit's weights taken once at load, on the stage's device and in its
dtype, so a check during a forward converts nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decoding.errors import DrafterError
from decoding.exits.heads import ExitHeads, exit_logits, first_exit_layer


@dataclass(frozen=True)
class ExitCheck:
    """One row's exit, when it clears the threshold: full-vocabulary logits (-inf off the shortlist, so
    the request's own sampler picks from the exit's distribution), where it left and how sure it was."""

    logits: torch.Tensor  # [vocab] float32
    layer: int  # decoder layers computed before it left
    margin: float


class BoundExits:
    """Exit heads bound to one stage: the exits inside its layers, with the LM head's shortlisted rows on
    its device and in its dtype (taken once at load)."""

    def __init__(self, heads: ExitHeads, stage):
        if heads.num_layers != stage.config.num_layers or heads.hidden_size != stage.config.hidden_size \
                or heads.vocab_size != stage.config.vocab_size:
            raise DrafterError(f"{heads.source}: exit heads do not fit this model "
                               f"({heads.num_layers} layers, hidden {heads.hidden_size}, vocab {heads.vocab_size})")
        if stage.lm_head is None or stage.final_norm is None:
            raise DrafterError("exits are checked where the LM head is: the last stage")
        if heads.layers[0] < first_exit_layer(heads.num_layers):
            raise DrafterError(f"{heads.source}: an exit after layer {heads.layers[0]} lets tokens leave before the "
                               f"last quarter of the model (after layer {first_exit_layer(heads.num_layers)}), "
                               "where a token is seldom settled: these are a verifier's preview heads")
        self.heads = heads
        self.dtype, self.eps = stage.dtype, stage.config.rms_eps
        self.final_norm = stage.final_norm.to(stage.dtype)
        self.rows = heads.head_rows(stage.lm_head, stage.dtype).to(stage.device)
        # each exit's weights once, in the stage's dtype and on its device (a check converts nothing)
        dev, dt = stage.device, stage.dtype
        self._weights = [(heads.w[j].detach().to(dev, dt), heads.b[j].detach().to(dev, dt),
                          heads.other_w[j].detach().to(dev), heads.other_b[j].detach().to(dev))
                         for j in range(len(heads.layers))]
        # exit j of the file -> the index in this stage's layer list after which it is checked
        self.at = {layer - stage.first - 1: j for j, layer in enumerate(heads.layers)
                   if stage.first < layer < stage.end}
        self.vocab = stage.config.vocab_size
        self.shortlist = heads.shortlist.to(stage.device)
        self.size = heads.size

    @property
    def layers(self) -> list[int]:
        return sorted(self.heads.layers[j] for j in self.at.values())

    def check(self, local_layer: int, hidden: torch.Tensor, thresholds: list[float]) -> list[ExitCheck | None]:
        """Exit or not for each row of ``hidden`` [n, d] after this stage's layer ``local_layer``."""
        j = self.at[local_layer]
        z = exit_logits(hidden, *self._weights[j], self.final_norm, self.rows, self.eps)
        p = torch.softmax(z, dim=-1)
        top = torch.topk(p, 2, dim=-1)
        margins = (top.values[:, 0] - top.values[:, 1]).tolist()
        best = top.indices[:, 0].tolist()
        out: list[ExitCheck | None] = []
        other = self.size
        for r, (m, b, thr) in enumerate(zip(margins, best, thresholds)):
            if b == other or m < thr:
                out.append(None)
                continue
            full = torch.full((self.vocab,), float("-inf"), device=z.device)
            full[self.shortlist] = z[r, :other]
            out.append(ExitCheck(full, self.heads.layers[j], float(m)))
        return out


__all__ = ["BoundExits", "ExitCheck"]
