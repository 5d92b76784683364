"""A tensor-parallel group in one process (a thread per member, ``decoding.tensor_group.ThreadGroup``):
the reference a group over links must equal, and the driver of the split's own tests."""

from __future__ import annotations

import queue
import threading

import torch

from decoding.models.llama.tensor_slice import layer_shape, member_stage
from decoding.tensor_group import ThreadGroup
from partition.tensor_split import split_layers


def run_group(stage, n: int, prompt: torch.Tensor, steps: int, speeds=None, per_op: bool = False,
              attention: str = "split", best_only: bool = False):
    """Each member in its own thread; returns per member (its logits [steps + 1, vocab], greedy tokens).
    ``best_only``: the decode steps gather each member's best token only (a greedy request's steps)."""
    return [per_prompt[0] for per_prompt in run_group_many(stage, n, [prompt], steps, speeds, per_op, attention,
                                                          best_only)]


def run_group_many(stage, n: int, prompts: list[torch.Tensor], steps: int, speeds=None, per_op=False,
                   attention: str = "split", best_only: bool = False):
    """One split of ``stage`` decoding every prompt alone, one after another (the exact reference for a group
    serving them together, whatever else it batches); returns per member, per prompt (logits, tokens).
    ``per_op``: True, or the ranks (a tuple) that take the per-operation path instead of the kernel's step."""
    split = split_layers(layer_shape(stage), n, speeds, attention)
    group = ThreadGroup(n, timeout_s=120)
    members = [member_stage(stage, m, group.member(m.rank)) for m in split.members]
    out: list = [None] * n

    chosen = [queue.Queue() for _ in range(n)]  # the first member's greedy tokens, to every other member

    def member(rank: int):
        slow = per_op is True or (bool(per_op) and rank in per_op)
        try:
            if rank == 0:
                tell = lambda t: [q.put(t) for q in chosen[1:]]  # noqa: E731
                out[0] = [decode(members[0], p, steps, slow, tell, best_only=best_only) for p in prompts]
            else:
                take = lambda: chosen[rank].get(timeout=120)  # noqa: E731
                out[rank] = [decode(members[rank], p, steps, slow, take=take, best_only=best_only) for p in prompts]
        except BaseException as exc:  # noqa: BLE001 - reported below
            out[rank] = exc
            group.abort()

    threads = [threading.Thread(target=member, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300 + 60 * len(prompts))
    for o in out:
        if isinstance(o, BaseException):
            raise o
    return out


def group_logits(stage, n: int, chunks: list[torch.Tensor], speeds=None, attention: str = "split") -> list[torch.Tensor]:
    """Every position's logits of each chunk (a fresh sequence each) as the group's first member gathers them:
    the group's teacher-forced view of a text, for its distance from one device."""
    split = split_layers(layer_shape(stage), n, speeds, attention)
    group = ThreadGroup(n, timeout_s=600)
    members = [member_stage(stage, m, group.member(m.rank)) for m in split.members]
    out: list = [None] * n

    def member(rank: int):
        try:
            got = []
            for c in chunks:
                kv = members[rank].new_cache(len(c) + 8)
                kv.create("f", len(c) + 8)
                got.append(members[rank].forward(kv, "f", c, all_logits=True).float())
            out[rank] = got
        except BaseException as exc:  # noqa: BLE001 - reported below
            out[rank] = exc
            group.abort()

    threads = [threading.Thread(target=member, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for o in out:
        if isinstance(o, BaseException):
            raise o
    return out[0]


def decode(stage, prompt: torch.Tensor, steps: int, per_op: bool = False, tell=None, take=None,
           best_only: bool = False):
    """Greedy steps; a member after the first ``take``s the first member's token (it holds only its share
    of the vocabulary), which the first member ``tell``s. ``best_only``: the steps ask for the best token
    alone (the prompt's row is gathered whole)."""
    from decoding.batch import BatchItem

    if per_op:
        stage._decode_steps = False  # the per-operation path for every row
    need = len(prompt) + steps + 1
    kv = stage.new_cache(max(512, need))
    kv.create("s", max(64, need))
    logits = [stage.forward(kv, "s", prompt, all_logits=False)[-1]]
    tokens = []
    for _ in range(steps):
        tokens.append(take() if take else int(logits[-1].argmax()))
        if tell:
            tell(tokens[-1])
        item = BatchItem("s", torch.tensor([tokens[-1]]), all_logits=False, best_only=best_only)
        logits.append(stage.forward_batch(kv, [item])[0][-1])
    return torch.stack(logits), tokens
