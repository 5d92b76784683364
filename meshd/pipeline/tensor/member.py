"""A tensor-parallel group's members after the first: each repeats the first member's cache operations and
passes (``grouped.GroupedStage`` sends them) on its own share of the layers and its own KV cache.

Why the first member sends what to run rather than every member reading the stage's inbox: the members
must run the same passes in the same order (each pass's partial sums pair up by number), so one member
decides the order and the others repeat it. What travels is small (the rows' token ids, the cache
operations); activations travel only as the layers' partial sums.
"""

from __future__ import annotations

import msgpack
import torch

from decoding.models.llama.tensor_slice import layer_shape, member_stage
from meshd.log import get_logger
from meshd.pipeline.tensor.grouped import apply_ops, decode_items
from partition.tensor_split import split_layers

log = get_logger("meshd.pipeline.tensor")


def load_member(source, first: int, end: int, size: int, rank: int, group, speeds=None, attention: str = "split"):
    """Member ``rank``'s share of ``[first, end)`` of ``source`` in the gguf mode, and the split it is part of
    (``attention``: how the group holds it, ``partition.tensor_split.ATTENTIONS``)."""
    whole = source.load_stage(first, end, torch.float32, packed="gguf")
    split = split_layers(layer_shape(whole), size, speeds, attention)
    stage = member_stage(whole, split.members[rank], group)
    del whole
    release = getattr(source, "release_pages", None)
    if release is not None:  # the member keeps its copied share; the file's pages are the page cache's again
        release()
    return stage, split


def follow(stage, link, stopping=None) -> None:
    """A member after the first: the first member's cache operations and passes, in its order, until it
    says stop (or ``stopping`` is set; or the group is lost: :class:`GroupLost`).

    Any failure ends the member (its caller closes its link, so the first member's wait ends too): the
    first member admits a pass only if it can finish it, and this member's cache has room to spare
    (``grouped.FOLLOWER_BUDGET``), so a pass refused here means the members are out of step."""
    kv = None
    while stopping is None or not stopping.is_set():
        raw = link.next_command(timeout_s=None if stopping is None else 0.2)
        if raw is None:
            continue
        cmd = msgpack.unpackb(raw)
        if cmd["op"] == "stop":
            return
        if cmd["op"] != "pass":
            raise ValueError(f"unknown group command {cmd['op']!r}")
        kv = apply_ops(stage, kv, cmd["kv"])
        link.begin_pass(int(cmd["pass"]))
        stage.forward_batch(kv, decode_items(cmd["items"]))
