"""Early-exit heads (Synera): a confident token leaves the model before its last layers.

At a few layers in the last quarter of the model, a small residual adapter
turns the hidden state into something the model's *own* final norm and LM head
can read. If the margin between the two most likely tokens clears the
request's threshold, the token is emitted without the remaining layers (the
stage still computes those layers' keys and values for the position right
after, so later tokens attend to complete KV: see ``decoding.exits.owed``).

Why a shortlist of the LM head's rows and not the whole head: on the models a
home runs, the LM head is the most expensive matrix of a decode step. On the
embedded SmolLM2-135M the full 49k-row head costs as much as 9 of its 30 layers
(bench/RESULTS.md, "Early exits"), so checking an exit with the whole head
would cost more than the 7 layers it can skip. The exit reads only the rows of
the S tokens the model says most often, plus one learned "other" logit that
stands for the rest of the vocabulary: the check costs a fraction of a layer,
and a position whose most likely class is "other" never exits. The heads are
trained (``decoding.training.exits``) to match the full model's distribution
collapsed onto those S + 1 classes, so the margin means what the paper's does.

The file holds plain tensors, ints, strings and lists only, is read with
``torch.load(weights_only=True)``, records the model it was trained for, and a
sha256 pin (``meshd.model.heads``) guards the shipped one — like the Medusa heads.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from decoding.errors import DrafterError
from decoding.heads_file import read_heads_file, write_heads_file

FORMAT = "meshd-exit-heads"
FORMAT_VERSION = 1
#: Exits are allowed only from this fraction of the model's layers on (the paper's last quarter).
EXIT_FROM_FRACTION = 0.75


def first_exit_layer(num_layers: int) -> int:
    """The smallest layer count after which an exit is allowed (the last quarter of the model)."""
    return math.ceil(num_layers * EXIT_FROM_FRACTION)


def default_exit_layers(num_layers: int, count: int = 3) -> list[int]:
    """``count`` exits spread over the last quarter, never after the last layer (that is the model itself)."""
    lo, hi = first_exit_layer(num_layers), num_layers - 1
    if hi < lo:
        return []
    if count <= 1 or hi == lo:
        return [lo]
    step = (hi - lo) / (count - 1)
    return sorted({lo + round(i * step) for i in range(count)})


def preview_exit_layers(num_layers: int, count: int = 4) -> list[int]:
    """Where a verifier's preview exits sit: ``count`` exits every few layers from ~40 % of the model to ~85 %.

    Why there and not after every layer (the paper's choice): each exit costs the verifier a
    check and the home a possible pre-draft, and a preview pays only when it comes early enough
    to draft the next round from it: an exit in the last ~15 % leads the final verdict by less
    than one drafted token. Before ~40 % an exit head of a few CPU-minutes' training rarely
    agrees with the final layer (``meshd heads train-exits`` reports the agreement per exit)."""
    lo, hi = max(1, round(num_layers * 0.4)), min(num_layers - 1, round(num_layers * 0.85))
    if hi < lo:
        return [lo] if lo < num_layers else []
    if count <= 1 or hi == lo:
        return [lo]
    step = (hi - lo) / (count - 1)
    return sorted({lo + round(i * step) for i in range(count)})


class ExitHeads(torch.nn.Module):
    """Per exit layer: a residual block (W, b) and an "other" logit (w_o, b_o); one shared shortlist.

    Exits may sit after any layer but the last: a home's Synera exits sit in the last quarter
    (:class:`~decoding.exits.bound.BoundExits` refuses others), a verifier's preview exits
    earlier (:func:`preview_exit_layers`).

    ``layers[j]`` is the number of decoder layers computed before exit j
    (an exit after layer index ``layers[j] - 1``).
    """

    def __init__(self, layers: list[int], hidden_size: int, shortlist: torch.Tensor, *, num_layers: int,
                 vocab_size: int, meta: dict | None = None):
        super().__init__()
        if not layers or sorted(set(layers)) != list(layers):
            raise ValueError("exit layers must be a non-empty increasing list")
        if layers[0] < 1 or layers[-1] >= num_layers:
            raise ValueError(f"exits must sit after a layer and before the last of {num_layers}, got {layers}")
        shortlist = torch.as_tensor(shortlist, dtype=torch.long).flatten()
        if shortlist.numel() < 2 or int(shortlist.min()) < 0 or int(shortlist.max()) >= vocab_size \
                or shortlist.unique().numel() != shortlist.numel():
            raise ValueError("the shortlist must hold at least 2 distinct token ids within the vocabulary")
        e, d = len(layers), hidden_size
        self.layers, self.hidden_size = list(layers), d
        self.num_layers, self.vocab_size = num_layers, vocab_size
        self.register_buffer("shortlist", shortlist)
        self.w = torch.nn.Parameter(torch.zeros(e, d, d))
        self.b = torch.nn.Parameter(torch.zeros(e, d))
        self.other_w = torch.nn.Parameter(torch.zeros(e, d))
        self.other_b = torch.nn.Parameter(torch.full((e,), -4.0))  # "other" starts unlikely; training moves it
        self.meta = dict(meta or {})
        self.source = "exit heads"

    @property
    def size(self) -> int:
        return int(self.shortlist.numel())

    def logits(self, j: int, hidden: torch.Tensor, final_norm: torch.Tensor, rows: torch.Tensor,
               eps: float) -> torch.Tensor:
        """Exit j's logits over the shortlist and "other" ([n, S + 1], float32) from hidden states [n, d].

        ``rows``: the LM head's shortlisted rows [S, d] (see :meth:`head_rows`); training passes them
        in float32 (a stage binds its own copies, :class:`BoundExits`)."""
        return exit_logits(hidden, self.w[j], self.b[j], self.other_w[j], self.other_b[j], final_norm, rows, eps)

    def head_rows(self, lm_head, dtype: torch.dtype) -> torch.Tensor:
        """The LM head's rows for the shortlist, dense, in ``dtype`` (a packed head widens only these)."""
        ids = self.shortlist.to(lm_head.device if isinstance(lm_head, torch.Tensor) else "cpu")
        rows = lm_head[ids] if isinstance(lm_head, torch.Tensor) else lm_head.lookup(ids)
        if rows.shape != (self.size, self.hidden_size):
            raise DrafterError(f"{self.source}: the LM head gave rows {tuple(rows.shape)}, "
                               f"expected [{self.size}, {self.hidden_size}]")
        return rows.to(dtype).contiguous()

    # -- the file ----------------------------------------------------------------------------------
    def save(self, path, meta: dict | None = None) -> str:
        """Write atomically; returns the file's sha256 (pin it where the file ships)."""
        if meta is not None:
            self.meta = dict(meta)
        return write_heads_file(path, {"format": FORMAT, "version": FORMAT_VERSION, "layers": list(self.layers),
                    "hidden_size": self.hidden_size, "num_layers": self.num_layers, "vocab_size": self.vocab_size,
                    "shortlist": self.shortlist.to(torch.int32).contiguous(),
                    "w": self.w.detach().to(torch.float16).contiguous(),
                    "b": self.b.detach().to(torch.float16).contiguous(),
                    "other_w": self.other_w.detach().to(torch.float16).contiguous(),
                    "other_b": self.other_b.detach().float().contiguous(),
                    "meta_json": json.dumps(self.meta, sort_keys=True)})

    @classmethod
    def load(cls, path, *, sha256: str | None = None, num_layers: int | None = None,
             hidden_size: int | None = None, vocab_size: int | None = None) -> "ExitHeads":
        """Read and check a heads file; ``sha256`` pins the exact file (a mismatch is refused)."""
        path, raw = read_heads_file(path, sha256, "exit heads")
        heads = cls._from_state(raw, path)
        heads.source = str(path)
        for name, want, have in (("layers", num_layers, heads.num_layers), ("hidden size", hidden_size,
                                 heads.hidden_size), ("vocabulary", vocab_size, heads.vocab_size)):
            if want is not None and want != have:
                raise DrafterError(f"{path}: exit heads are for a model with {name} {have}, this one has {want} "
                                   f"(heads belong to one model)")
        return heads

    @classmethod
    def _from_state(cls, raw, path: Path) -> "ExitHeads":
        def bad(why: str) -> DrafterError:
            return DrafterError(f"{path}: not a valid exit heads file ({why})")

        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise bad("missing format tag")
        if raw.get("version") != FORMAT_VERSION:
            raise bad(f"format version {raw.get('version')!r}, this meshd reads {FORMAT_VERSION}")
        layers, d, nl, v = raw.get("layers"), raw.get("hidden_size"), raw.get("num_layers"), raw.get("vocab_size")
        if not isinstance(layers, list) or not all(isinstance(x, int) for x in layers) \
                or not all(isinstance(x, int) and x > 0 for x in (d, nl, v)):
            raise bad("layers/hidden_size/num_layers/vocab_size missing")
        e = len(layers)
        tensors = {k: raw.get(k) for k in ("shortlist", "w", "b", "other_w", "other_b")}
        shapes = {"w": (e, d, d), "b": (e, d), "other_w": (e, d), "other_b": (e,)}
        for k, shape in shapes.items():
            t = tensors[k]
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or not torch.isfinite(t).all():
                raise bad(f"{k} must be finite, shaped {list(shape)}")
        if not isinstance(tensors["shortlist"], torch.Tensor) or tensors["shortlist"].ndim != 1:
            raise bad("shortlist must be a 1-d tensor of token ids")
        try:
            meta = json.loads(raw.get("meta_json") or "{}")
            heads = cls(layers, d, tensors["shortlist"], num_layers=nl, vocab_size=v, meta=meta)
        except (TypeError, ValueError) as exc:
            raise bad(str(exc)) from exc
        with torch.no_grad():
            for k in shapes:
                getattr(heads, k).copy_(tensors[k].float())
        heads.requires_grad_(False)
        heads.eval()
        return heads


def exit_logits(hidden: torch.Tensor, w: torch.Tensor, b: torch.Tensor, other_w: torch.Tensor, other_b: torch.Tensor,
                final_norm: torch.Tensor, rows: torch.Tensor, eps: float) -> torch.Tensor:
    """One exit: the residual block, the model's final RMSNorm, the shortlisted head rows and "other".
    ``rows``: the rows [S, d], or a callable multiplying by them (a gguf head's own blocks of those rows)."""
    h = hidden + F.silu(F.linear(hidden, w, b))
    var = h.float().pow(2).mean(-1, keepdim=True)
    n = (h.float() * torch.rsqrt(var + eps)).to(hidden.dtype) * final_norm
    short = (F.linear(n, rows) if isinstance(rows, torch.Tensor) else rows(n)).float()
    other = (n.float() @ other_w.float() + other_b.float()).unsqueeze(-1)
    return torch.cat([short, other], dim=-1)


__all__ = ["EXIT_FROM_FRACTION", "ExitHeads", "default_exit_layers", "exit_logits", "first_exit_layer",
           "preview_exit_layers"]
