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
    chosen = [queue.Queue() for _ in range(n)]  # the first member's greedy tokens, to every other member

    def member(rank: int, stage) -> list:
        slow = per_op is True or (bool(per_op) and rank in per_op)
        if rank == 0:
            tell = lambda t: [q.put(t) for q in chosen[1:]]  # noqa: E731
            return [decode(stage, p, steps, slow, tell, best_only=best_only) for p in prompts]
        take = lambda: chosen[rank].get(timeout=120)  # noqa: E731
        return [decode(stage, p, steps, slow, take=take, best_only=best_only) for p in prompts]

    return in_member_threads(stage, n, speeds, attention, member, 120)


def group_logits(stage, n: int, chunks: list[torch.Tensor], speeds=None, attention: str = "split") -> list[torch.Tensor]:
    """Every position's logits of each chunk (a fresh sequence each) as the group's first member gathers them:
    the group's teacher-forced view of a text, for its distance from one device."""
    def member(rank: int, stage) -> list:
        got = []
        for c in chunks:
            kv = stage.new_cache(len(c) + 8)
            kv.create("f", len(c) + 8)
            got.append(stage.forward(kv, "f", c, all_logits=True).float())
        return got

    return in_member_threads(stage, n, speeds, attention, member, 600)[0]


def in_member_threads(stage, n: int, speeds, attention: str, work, timeout_s: float) -> list:
    """``stage`` split over ``n`` members of an in-process group, ``work(rank, member_stage)`` run in a thread
    per member; returns each member's result (a member's failure ends the others' waits, and is raised)."""
    split = split_layers(layer_shape(stage), n, speeds, attention)
    group = ThreadGroup(n, timeout_s=timeout_s)
    members = [member_stage(stage, m, group.member(m.rank)) for m in split.members]
    out: list = [None] * n

    def run(rank: int) -> None:
        try:
            out[rank] = work(rank, members[rank])
        except BaseException as exc:  # noqa: BLE001 - reported below
            out[rank] = exc
            group.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for o in out:
        if isinstance(o, BaseException):
            raise o
    return out


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
