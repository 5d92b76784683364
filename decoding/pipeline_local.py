"""The model as K in-process stages, prompt fed in sub-sequences.

This is the correctness twin of the distributed pipeline: same stage code,
same chunked prefill (chunk i attends to chunks < i through each stage's KV
cache), no network. ``--stages 1 --chunks 1`` is the single-device reference.

Stages may sit on different devices (one on a GPU, one on the CPU): each moves
its input to itself, and what the pipeline returns is always on the host, moved
there once per forward, the way a mesh's last stage hands results back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from decoding.device import CPU, default_dtype, to_host
from decoding.errors import ContextOverflow
from decoding.models import StageModel


def even_split(total: int, parts: int) -> list[tuple[int, int]]:
    """[first, end) ranges of near-equal size covering range(total)."""
    if not 1 <= parts <= total:
        raise ValueError(f"cannot split {total} items into {parts} parts")
    base, extra = divmod(total, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def chunk_bounds(n: int, chunks: int | None = None, cuts: list[int] | None = None) -> list[tuple[int, int]]:
    """Sub-sequence [start, end) bounds for an n-token prompt: explicit cut points or C equal chunks."""
    if cuts:
        points = [0] + sorted(c for c in cuts if 0 < c < n) + [n]
        return [(a, b) for a, b in zip(points, points[1:]) if b > a]
    return even_split(n, max(1, min(chunks or 1, n)))


class LocalPipeline:
    def __init__(self, stages: list[StageModel], max_tokens: int = 1 << 16):
        self.stages = stages
        self.caches = [s.new_cache(max_tokens) for s in stages]
        self.config = stages[0].config
        self._host_out = stages[-1].device.type == "cpu"  # decided once: no per-token device test

    @classmethod
    def from_source(cls, source, num_stages: int = 1, dtype: torch.dtype | None = None,
                    device: "torch.device | str | Sequence[torch.device | str] | None" = None,
                    packed: str | bool = "") -> "LocalPipeline":
        """``num_stages`` even stages; ``device``: one for all, or one per stage (default: the CPU).

        ``dtype`` None: each stage's device default (float32 on the CPU, see ``decoding.device``);
        ``packed``: a packed numeric mode ("packed", "packed4"; give ``dtype`` bfloat16).
        """
        ranges = even_split(source.config.num_layers, num_stages)
        if device is None or isinstance(device, (str, torch.device)):
            devices = [CPU if device is None else torch.device(device)] * num_stages
        else:
            devices = [torch.device(d) for d in device]
            if len(devices) != num_stages:
                raise ValueError(f"{len(devices)} devices for {num_stages} stages")
        return cls([source.load_stage(a, b, dtype or default_dtype(d), d, packed)
                    for (a, b), d in zip(ranges, devices)])

    @property
    def devices(self) -> list[torch.device]:
        return [s.device for s in self.stages]

    @property
    def layer_ranges(self) -> list[tuple[int, int]]:
        return [(s.first, s.end) for s in self.stages]

    def create(self, seq_id, capacity: int) -> None:
        if capacity > self.config.max_position:
            raise ContextOverflow(
                f"{capacity} positions requested; the model's context is {self.config.max_position}")
        for c in self.caches:
            c.create(seq_id, capacity)

    def free(self, seq_id) -> None:
        for c in self.caches:
            c.free(seq_id)

    def truncate(self, seq_id, length: int) -> None:
        for c in self.caches:
            c.truncate(seq_id, length)

    def fork(self, parent, child, prefix_len=None, capacity: int = 64) -> None:
        for c in self.caches:
            c.fork(parent, child, prefix_len, capacity)

    def keep(self, seq_id, start: int, keep: list[int]) -> None:
        """After verifying a token tree written at ``start``: keep the accepted nodes, in order."""
        for c in self.caches:
            c.keep(seq_id, start, keep)

    def forward(self, seq_id, x: torch.Tensor, tree_mask=None, all_logits: bool = False,
                return_normed: bool = False):
        """Logits (and, with ``return_normed``, the final-normed hidden states) of the new positions, on the host."""
        for stage, cache in zip(self.stages, self.caches):
            x = stage.forward(cache, seq_id, x, tree_mask=tree_mask, all_logits=all_logits,
                              return_normed=return_normed and stage.is_last)
        return x if self._host_out else to_host(x)

    def prefill(self, seq_id, ids: list[int], chunks: int = 1, cuts: list[int] | None = None,
                all_logits: bool = False, return_normed: bool = False):
        """Feed the prompt chunk by chunk; returns the logits of the last chunk (and its normed hidden)."""
        out = None
        for a, b in chunk_bounds(len(ids), chunks, cuts):
            out = self.forward(seq_id, torch.tensor(ids[a:b], dtype=torch.long, device="cpu"), all_logits=all_logits,
                               return_normed=return_normed)
        return out
