"""A verifier's early verdicts: exit heads inside its model judge the home's drafts before its last layers do.

The early-exit edge–cloud paper's half of early exits. While a cloud verifier runs a
verify round, after each exit layer it reads the drafts' rows through that exit's head
and walks the drafts as the final verdict will (greedy: accept while the draft is the
exit's best token, then the exit's best token). The home can start drafting the next
round from such a preview while the verifier's last layers still run; the final layer
alone decides what is committed, so a wrong preview costs only the pre-draft.
A sampled request's preview walks the drafts with the very uniforms the final
verdict will draw (a fork of the session's stream), so it agrees with the final
verdict whenever the exit's distribution is close to the model's.

Why the exit's verdict is withheld when a row it reads says "other" (a token off the
shortlist): the exit cannot name that token, so it has no verdict to offer.
``confidence`` is the least sure of the rows the verdict read (each row's max
probability, the paper's confidence): a preview is as sure as its weakest step.

Same heads file as a home's exits (:mod:`decoding.exits.heads`); only where they sit
differs (:func:`~decoding.exits.heads.preview_exit_layers`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from decoding.errors import DrafterError
from decoding.exits.heads import ExitHeads, exit_logits
from decoding.sampling import SamplingParams
from decoding.speculative.verify import Uniform, verify_offloaded


@dataclass(frozen=True)
class Preview:
    """Exit ``layer``'s verdict on a chain of drafts: ``accepted`` of them, then its ``token``."""

    layer: int
    accepted: int
    token: int
    confidence: float


class PreviewExits:
    """Exit heads bound to a verifier's whole-model stage, in float32 on its device (taken once at load)."""

    def __init__(self, heads: ExitHeads, stage, layers: Sequence[int] | None = None):
        """``layers``: the heads' exits to preview at (default all): each costs the verifier a check a round."""
        cfg = stage.config
        if (heads.num_layers, heads.hidden_size, heads.vocab_size) != (cfg.num_layers, cfg.hidden_size,
                                                                        cfg.vocab_size):
            raise DrafterError(f"{heads.source}: exit heads do not fit this model "
                               f"({heads.num_layers} layers, hidden {heads.hidden_size}, vocab {heads.vocab_size})")
        if not (stage.is_first and stage.is_last):
            raise DrafterError("previews are computed by a verifier holding the whole model")
        if layers is not None and not set(layers) <= set(heads.layers):
            raise DrafterError(f"{heads.source}: no exit after layer(s) {sorted(set(layers) - set(heads.layers))} "
                               f"(it has {heads.layers})")
        self.heads = heads
        self._layers = sorted(set(layers)) if layers is not None else list(heads.layers)
        self.eps = cfg.rms_eps
        dev = stage.device
        self.final_norm = stage.final_norm.to(dev, torch.float32)
        # A gguf head multiplies by its own blocks of the shortlisted rows: ~0.8 byte a weight read per check
        # instead of 4 (the check reads them every round, for every exit).
        self.rows = stage.lm_head.only(heads.shortlist) if hasattr(stage.lm_head, "only") and dev.type == "cpu" \
            else heads.head_rows(stage.lm_head, torch.float32).to(dev)
        self._weights = {layer: (heads.w[j].detach().to(dev, torch.float32), heads.b[j].detach().to(dev, torch.float32),
                                 heads.other_w[j].detach().to(dev), heads.other_b[j].detach().to(dev))
                         for j, layer in enumerate(heads.layers) if layer in self._layers}
        self.shortlist = heads.shortlist.tolist()
        self._shortlist = heads.shortlist.to(dev)
        self.other = heads.size
        self.vocab = cfg.vocab_size

    @property
    def layers(self) -> list[int]:
        return list(self._layers)

    def _exit(self, layer: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Exit ``layer``'s logits over the shortlist and "other", and each row's confidence and best class."""
        z = exit_logits(hidden.to(torch.float32), *self._weights[layer], self.final_norm, self.rows, self.eps)
        conf, best = torch.softmax(z, dim=-1).max(dim=-1)
        return z, conf, best

    @torch.inference_mode()
    def verdict(self, layer: int, hidden: torch.Tensor, drafts: Sequence[int]) -> Preview | None:
        """Exit ``layer``'s greedy verdict from the rows of the root and the drafts (``hidden`` [d + 1, hidden],
        the root's row first), or None when a row it reads points off the shortlist."""
        if hidden.shape[0] != len(drafts) + 1:
            raise ValueError(f"{hidden.shape[0]} rows for {len(drafts)} drafts (the root's row comes first)")
        _, conf, best = self._exit(layer, hidden)
        conf, best = conf.tolist(), best.tolist()
        sure = 1.0
        for i, b in enumerate(best):
            if b == self.other:
                return None
            sure = min(sure, conf[i])
            token = self.shortlist[b]
            if i == len(drafts) or token != drafts[i]:
                return Preview(layer, i, token, sure)
        raise AssertionError("unreachable: the last row always ends the walk")

    @torch.inference_mode()
    def sampled_verdict(self, layer: int, hidden: torch.Tensor, drafts: Sequence[int], root: int,
                        params: SamplingParams, uniform: Uniform, support=None) -> Preview | None:
        """Exit ``layer``'s verdict on sampled drafts: the final verdict's own walk (rejection sampling, or
        candidates sampled) over the exit's distribution on the shortlist, with the uniforms the final
        verdict will draw (``uniform``: a fork of the session's stream). None when a row it reads is
        most likely "other"."""
        z, conf, best = self._exit(layer, hidden)
        full = torch.full((z.shape[0], self.vocab), float("-inf"), device=z.device)
        full[:, self._shortlist] = z[:, :self.other]
        v = verify_offloaded(list(drafts), root, full, params, uniform, support)
        read = slice(0, v.accepted + 1)
        if bool((best[read] == self.other).any()):
            return None
        return Preview(layer, v.accepted, int(v.next_token), float(conf[read].min()))


__all__ = ["Preview", "PreviewExits"]
