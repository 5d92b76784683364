"""The members of a tensor-parallel group: the first leads (it owns the sequences and says what each pass
runs), the others follow its commands on their own share of the layers and their own KV cache.

Why the leader sends commands rather than the followers reading the stage's inbox too: the members must
run the same passes in the same order (each pass's reductions pair up by number), so one member decides
the order and the others replay it. A command is small (the token ids or the cache operation), the
activations never travel except as the layer's partial sums.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import msgpack
import torch

from decoding.kv_cache import KVCache
from decoding.models.llama.tensor_slice import layer_shape, member_stage
from decoding.errors import CacheError, ContextOverflow
from meshd.log import get_logger
from partition.tensor_split import TensorSplit, split_layers

log = get_logger("meshd.pipeline.tensor")


@dataclass(frozen=True)
class GroupCommand:
    """One thing every member does, in the leader's order."""

    op: str  # "create" | "forward" | "free" | "truncate" | "stop"
    seq: str = ""
    ids: tuple[int, ...] = ()  # forward: the token ids of the rows
    length: int = 0  # create: capacity; truncate: the length kept
    all_logits: bool = False

    def encode(self) -> bytes:
        return msgpack.packb(asdict(self))

    @classmethod
    def decode(cls, raw: bytes) -> "GroupCommand":
        d = msgpack.unpackb(raw)
        d["ids"] = tuple(d.get("ids", ()))
        return cls(**d)


def load_member(source, first: int, end: int, size: int, rank: int, group, speeds=None):
    """Member ``rank``'s share of ``[first, end)`` of ``source`` in the gguf mode, and the split it is part of."""
    whole = source.load_stage(first, end, torch.float32, packed="gguf")
    split = split_layers(layer_shape(whole), size, speeds)
    stage = member_stage(whole, split.members[rank], group)
    del whole
    release = getattr(source, "release_pages", None)
    if release is not None:  # the member keeps its copied share; the file's pages are the page cache's again
        release()
    return stage, split


@dataclass
class _Sequences:
    """A member's KV cache and the operations every member applies to it alike."""

    stage: object
    max_tokens: int
    kv: KVCache = field(init=False)

    def __post_init__(self):
        self.kv = self.stage.new_cache(self.max_tokens)

    def apply(self, cmd: GroupCommand):
        if cmd.op == "create":
            self.kv.create(cmd.seq, cmd.length)
        elif cmd.op == "free":
            self.kv.free(cmd.seq)
        elif cmd.op == "truncate":
            self.kv.truncate(cmd.seq, cmd.length)
        elif cmd.op == "forward":
            return self.stage.forward(self.kv, cmd.seq, torch.tensor(cmd.ids, dtype=torch.long),
                                      all_logits=cmd.all_logits)
        else:
            raise ValueError(f"unknown group command {cmd.op!r}")
        return None


class GroupLeader:
    """The first member: each operation is sent to the others, then done here (they do it alongside)."""

    def __init__(self, stage, link, split: TensorSplit, max_tokens: int = 1 << 14):
        self.stage, self.split = stage, split
        self._link = link
        self._seqs = _Sequences(stage, max_tokens)

    def create(self, seq: str, capacity: int) -> None:
        self._do(GroupCommand("create", seq, length=capacity))

    def forward(self, seq: str, ids: list[int], all_logits: bool = False) -> torch.Tensor:
        """Logits [rows, vocab] (whole rows: the members' vocabulary shares gathered)."""
        return self._do(GroupCommand("forward", seq, tuple(int(i) for i in ids), all_logits=all_logits))

    def truncate(self, seq: str, length: int) -> None:
        self._do(GroupCommand("truncate", seq, length=length))

    def free(self, seq: str) -> None:
        self._do(GroupCommand("free", seq))

    def stop(self) -> None:
        self._link.send_command(GroupCommand("stop").encode())

    def _do(self, cmd: GroupCommand):
        self._link.send_command(cmd.encode())
        return self._seqs.apply(cmd)


def follow(stage, link, max_tokens: int = 1 << 14) -> None:
    """A member after the first: the leader's commands, one after another, until it says stop or leaves.
    Any other failure ends the member (its caller closes its link, so the leader's wait ends too): a
    member that skipped part of a pass would pair the wrong partial sums from then on."""
    seqs = _Sequences(stage, max_tokens)
    while True:
        raw = link.next_command()
        cmd = GroupCommand.decode(raw)
        if cmd.op == "stop":
            return
        try:
            seqs.apply(cmd)
        except (CacheError, ContextOverflow) as exc:
            # refused before any partial sum, on a cache that mirrors the leader's: the leader was refused
            # the same way, so the members stay in step
            log.warning("group_command_refused", op=cmd.op, seq=cmd.seq, error=str(exc))
