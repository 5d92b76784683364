"""Medusa-1 training: AdamW on the heads over cached hidden states, the backbone frozen.

The data (self-distilled answers, their hidden states) comes from
``decoding.training.medusa_data``; what the trained heads are worth on held-out
answers is ``decoding.training.medusa_eval``.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from decoding.errors import DrafterError
from decoding.log import get_logger
from decoding.medusa import MedusaHeads
from decoding.training.medusa_data import IGNORE, HiddenSet

log = get_logger("medusa_train")


@dataclass(frozen=True)
class TrainConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_fraction: float = 0.05
    batch_size: int = 128
    decay: float = 0.8  # loss weight of head k is decay**(k+1)
    seed: int = 0
    bf16: bool = True  # LM-head product in bfloat16 during training (about 2x faster on CPU)


def head_weights(num_heads: int, decay: float) -> torch.Tensor:
    return torch.tensor([decay ** (k + 1) for k in range(num_heads)])


def medusa_loss(heads: MedusaHeads, hidden: torch.Tensor, targets: torch.Tensor, lm_head: torch.Tensor,
                weights: torch.Tensor, bf16: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_k w_k · CE(head_k, target_k), averaged over positions; also each head's mean CE (detached)."""
    y = heads.residual(hidden)  # [B, K, d]
    valid = targets != IGNORE
    rows = y[valid]  # [M, d]
    tg = targets[valid]
    head_of = valid.nonzero()[:, 1]
    if bf16:
        logits = F.linear(rows.to(torch.bfloat16), lm_head.to(torch.bfloat16)).float()
    else:
        logits = F.linear(rows, lm_head)
    ce = F.cross_entropy(logits, tg, reduction="none")
    loss = (ce * weights[head_of]).sum() / hidden.shape[0]
    with torch.no_grad():
        per_head = torch.zeros(heads.num_heads).index_add_(0, head_of, ce.detach())
        counts = torch.zeros(heads.num_heads).index_add_(0, head_of, torch.ones_like(ce))
        per_head = per_head / counts.clamp(min=1)
    return loss, per_head


def lr_at(step: int, warmup_steps: int, progress: float, base: float) -> float:
    """Linear warm-up over the first steps, then cosine decay by ``progress`` in [0, 1]."""
    warm = min(1.0, (step + 1) / max(1, warmup_steps))
    return base * warm * 0.5 * (1.0 + math.cos(math.pi * min(1.0, max(0.0, progress))))


def train_heads(heads: MedusaHeads, data: HiddenSet, lm_head: torch.Tensor, steps: int,
                cfg: TrainConfig = TrainConfig(), deadline: float | None = None,
                on_step: Callable[[int, float], None] | None = None) -> dict:
    """AdamW, linear warm-up, cosine decay, over at most ``steps`` mini-batches of shuffled positions.

    With a ``deadline`` (a ``time.monotonic()`` value) the schedule follows
    whichever is further along, the steps or the time, and training stops when
    either runs out: on a machine that slows down mid-run (a shared CPU) the
    learning rate still reaches zero on time instead of being cut off high.
    """
    if len(data) == 0:
        raise DrafterError("no training positions (did generation produce any answers?)")
    lm_head = lm_head.detach().float()
    lm_lp = lm_head.to(torch.bfloat16) if cfg.bf16 else lm_head
    weights = head_weights(heads.num_heads, cfg.decay)
    heads.train()
    heads.requires_grad_(True)
    opt = torch.optim.AdamW(heads.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    warmup = max(1, int(steps * cfg.warmup_fraction))
    order = torch.randperm(len(data), generator=gen)
    cursor = 0
    losses: list[float] = []
    t0 = time.monotonic()
    span = None if deadline is None else max(1e-3, deadline - t0)
    done = 0
    stopped_by = "steps"
    for step in range(steps):
        progress = step / steps
        if span is not None:
            progress = max(progress, (time.monotonic() - t0) / span)
        if progress >= 1.0:
            stopped_by = "time"
            log.info("medusa_train_time_budget", step=step, planned=steps)
            break
        if cursor + cfg.batch_size > len(order):
            order, cursor = torch.randperm(len(data), generator=gen), 0
        idx = order[cursor:cursor + cfg.batch_size]
        cursor += cfg.batch_size
        lr = lr_at(step, warmup, (progress - cfg.warmup_fraction) / (1.0 - cfg.warmup_fraction), cfg.lr)
        for g in opt.param_groups:
            g["lr"] = lr
        loss, _ = medusa_loss(heads, data.hidden[idx], data.targets[idx], lm_lp, weights, cfg.bf16)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        done = step + 1
        if on_step:
            on_step(step, losses[-1])
    heads.eval()
    heads.requires_grad_(False)
    return {"steps": done, "planned_steps": steps, "stopped_by": stopped_by,
            "seconds": round(time.monotonic() - t0, 1),
            "epochs": round(done * cfg.batch_size / len(data), 2),
            "first_loss": losses[0] if losses else None,
            "last_loss": sum(losses[-20:]) / len(losses[-20:]) if losses else None}


@torch.inference_mode()
def mean_loss(heads: MedusaHeads, data: HiddenSet, lm_head: torch.Tensor, decay: float = 0.8,
              limit: int | None = None) -> float:
    n = len(data) if limit is None else min(limit, len(data))
    weights = head_weights(heads.num_heads, decay)
    total = 0.0
    for s in range(0, n, 256):
        e = min(n, s + 256)
        loss, _ = medusa_loss(heads, data.hidden[s:e], data.targets[s:e], lm_head.float(), weights)
        total += float(loss) * (e - s)
    return total / max(1, n)



def time_one_step(heads: MedusaHeads, data: HiddenSet, lm_head: torch.Tensor, cfg: TrainConfig) -> float:
    """Seconds per optimisation step, measured on a scratch copy (two steps after a warm-up)."""
    scratch = copy.deepcopy(heads)
    scratch.requires_grad_(True)
    lm = lm_head.to(torch.bfloat16) if cfg.bf16 else lm_head
    w = head_weights(scratch.num_heads, cfg.decay)
    n = min(cfg.batch_size, len(data))
    times = []
    for _ in range(3):
        t = time.monotonic()
        loss, _ = medusa_loss(scratch, data.hidden[:n], data.targets[:n], lm, w, cfg.bf16)
        loss.backward()
        times.append(time.monotonic() - t)
    return max(1e-4, min(times[1:]) * 1.1)  # + optimizer step and batching overhead


__all__ = ["TrainConfig", "head_weights", "lr_at", "mean_loss", "medusa_loss", "time_one_step", "train_heads"]
