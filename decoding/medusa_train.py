"""Medusa-1 training: self-distilled answers, cached hidden states, frozen backbone.

Why self-distillation: the heads must guess what *this* model will say next,
so the best teacher is the model itself — its own greedy answers to a varied
prompt set (shipped with meshd; nothing comes from a model hub). Any token the
heads learn to predict there is a token greedy verification will accept.

Why cache hidden states: the backbone is frozen, so each answer position's
final-normed hidden state (exactly what the pipeline's last stage feeds the
heads) is computed once with the project's own runtime and reused every
epoch; training then only runs the K residual blocks and the shared LM head.

Answers may be generated with transformers' batched ``generate`` on the same
weights (several times faster on a CPU than token-by-token decoding). They are
then checked against the runtime: each answer is cut at the first token that
is not the runtime's own greedy choice given the prefix, so what the heads
train and are evaluated on is the runtime's greedy continuation, token for token.

Positions: the hidden state at t (an answer position, or the prompt's last
token) has the model's own next token x[t+1] from the LM head; head k
(0-based) is trained on x[t+k+2] with weight 0.8**(k+1) (Medusa's λ_k = 0.8^k
for its 1-based heads).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from decoding.errors import DrafterError
from decoding.log import get_logger
from decoding.medusa import MedusaHeads, build_tree, chain_tree, expected_accepted
from decoding.models.llama import rms_norm

log = get_logger("medusa_train")

IGNORE = -100
HELDOUT_FRACTION = 0.15
RANKS = 10  # per-head ranks whose accuracy is measured (the tree uses at most these)


# -- prompts and answers -------------------------------------------------------------
@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str

    @property
    def heldout(self) -> bool:
        return is_heldout(self.id)


def is_heldout(prompt_id: str, fraction: float = HELDOUT_FRACTION) -> bool:
    """A stable split by the id's hash: adding prompts never moves old ones between splits."""
    h = int.from_bytes(hashlib.sha256(prompt_id.encode()).digest()[:8], "big")
    return h / 2.0 ** 64 < fraction


def load_prompts(path) -> list[Prompt]:
    path = Path(path)
    if not path.is_file():
        raise DrafterError(f"prompt file not found: {path}")
    out, seen = [], set()
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
            p = Prompt(str(raw["id"]), str(raw.get("category", "")), str(raw["prompt"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise DrafterError(f"{path}:{n}: expected a JSON object with 'id' and 'prompt' ({exc})") from exc
        if p.id in seen:
            raise DrafterError(f"{path}:{n}: duplicate prompt id {p.id!r}")
        seen.add(p.id)
        out.append(p)
    if not out:
        raise DrafterError(f"{path}: no prompts")
    return out


@dataclass
class Example:
    prompt_id: str
    heldout: bool
    prompt_ids: list[int]
    answer_ids: list[int]  # greedy answer (ends with EOS when the model stopped)


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat([{"role": "user", "content": text}])


def generate_runtime(stage, prompts_ids: Sequence[list[int]], max_new_tokens: int, eos_ids,
                     on_done: Callable[[int], None] | None = None) -> list[list[int]]:
    """Greedy answers with the project's runtime, one sequence at a time (exact, slower)."""
    out = []
    kv = stage.new_cache()
    for i, ids in enumerate(prompts_ids):
        seq = ("gen", i)
        kv.create(seq, len(ids) + max_new_tokens + 1)
        try:
            logits = stage.forward(kv, seq, torch.tensor(ids, dtype=torch.long), all_logits=False)
            ans: list[int] = []
            for _ in range(max_new_tokens):
                tok = int(logits[-1].argmax())
                ans.append(tok)
                if tok in eos_ids or len(ans) == max_new_tokens:
                    break
                logits = stage.forward(kv, seq, torch.tensor([tok], dtype=torch.long))
        finally:
            kv.free(seq)
        out.append(ans)
        if on_done:
            on_done(len(ans))
    return out


class TransformersGenerator:
    """Batched greedy answers with transformers on the same weights (GGUF or HF directory)."""

    def __init__(self, model_path, dtype: torch.dtype = torch.float32):
        from transformers import AutoModelForCausalLM

        p = Path(model_path)
        kw = {"dtype": dtype}
        if p.is_file():
            self.model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, **kw)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(str(p), **kw)
        self.model.eval()

    @torch.inference_mode()
    def generate(self, batch: Sequence[list[int]], max_new_tokens: int, eos_ids, pad_id: int) -> list[list[int]]:
        width = max(len(ids) for ids in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, ids in enumerate(batch):  # left padding: every row's next token is at the same column
            input_ids[r, width - len(ids):] = torch.tensor(ids)
            mask[r, width - len(ids):] = 1
        out = self.model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                  do_sample=False, eos_token_id=list(eos_ids), pad_token_id=pad_id,
                                  temperature=None, top_p=None, top_k=None)
        answers = []
        for row in out[:, width:].tolist():
            ans = []
            for tok in row:
                ans.append(tok)
                if tok in eos_ids:
                    break
            answers.append(ans)
        return answers


# -- hidden states -------------------------------------------------------------------
@dataclass
class HiddenSet:
    """Answer positions of some examples: normed hidden at t, the root x[t+1], and the heads' targets."""

    hidden: torch.Tensor   # [N, d] float32
    root: torch.Tensor     # [N] the model's own next token x[t+1]
    targets: torch.Tensor  # [N, K] x[t+k+2], IGNORE past the end
    spans: list[tuple[int, int]] = field(default_factory=list)  # per example: rows [start, end)

    def __len__(self) -> int:
        return self.hidden.shape[0]


@dataclass
class RuntimeCheck:
    answers: int = 0
    tokens: int = 0
    kept_tokens: int = 0
    cut_answers: int = 0  # answers cut where the runtime's greedy token differed

    def to_dict(self) -> dict:
        return {"answers": self.answers, "answer_tokens": self.tokens, "kept_tokens": self.kept_tokens,
                "answers_cut": self.cut_answers,
                "kept_fraction": round(self.kept_tokens / self.tokens, 4) if self.tokens else None}


@torch.inference_mode()
def runtime_hidden(stage, ids: list[int]) -> torch.Tensor:
    """Final-normed hidden states [n, d] of the whole sequence, from the project's runtime."""
    kv = stage.new_cache()
    seq = "medusa-hidden"
    kv.create(seq, len(ids))
    try:
        h = stage.forward(kv, seq, torch.tensor(ids, dtype=torch.long), head=False)
    finally:
        kv.free(seq)
    return rms_norm(h, stage.final_norm, stage.config.rms_eps).float()


def collect_hidden(stage, examples: Sequence[Example], num_heads: int,
                   check: RuntimeCheck | None = None,
                   on_done: Callable[[int], None] | None = None) -> HiddenSet:
    """Run each prompt+answer once through the runtime; keep the answer positions' hidden states.

    Each answer is cut at the first token that is not the runtime's greedy
    choice (``check`` counts how often), so the rows are the runtime's greedy
    continuation exactly.
    """
    hs, roots, tgts, spans = [], [], [], []
    n = 0
    lm_head = stage.lm_head.float()
    for ex in examples:
        ids = list(ex.prompt_ids) + list(ex.answer_ids)
        p = len(ex.prompt_ids)
        h = runtime_hidden(stage, ids).clone()  # a normal tensor: training differentiates through it
        with torch.no_grad():
            greedy = F.linear(h[p - 1:len(ids) - 1], lm_head).argmax(-1).tolist()
        keep = len(ex.answer_ids)
        for j, (g, a) in enumerate(zip(greedy, ex.answer_ids)):
            if g != a:
                keep = j
                break
        if check is not None:
            check.answers += 1
            check.tokens += len(ex.answer_ids)
            check.kept_tokens += keep
            check.cut_answers += keep < len(ex.answer_ids)
        seq = torch.tensor(ids[:p + keep], dtype=torch.long)
        length = p + keep
        # rows t = p-1 .. length-3: the root x[t+1] and at least head 0's target x[t+2] exist
        t = torch.arange(p - 1, length - 2)
        if len(t) > 0:
            hs.append(h[t])
            roots.append(seq[t + 1])
            idx = t.unsqueeze(1) + torch.arange(num_heads).unsqueeze(0) + 2
            tgt = torch.where(idx < length, seq[idx.clamp(max=length - 1)], torch.full_like(idx, IGNORE))
            tgts.append(tgt)
            spans.append((n, n + len(t)))
            n += len(t)
        if on_done:
            on_done(len(ids))
    d = stage.config.hidden_size
    if not hs:
        return HiddenSet(torch.zeros(0, d), torch.zeros(0, dtype=torch.long),
                         torch.zeros(0, num_heads, dtype=torch.long), [])
    return HiddenSet(torch.cat(hs), torch.cat(roots), torch.cat(tgts), spans)


# -- training ------------------------------------------------------------------------
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


# -- evaluation ----------------------------------------------------------------------
@torch.inference_mode()
def ranked_predictions(heads: MedusaHeads, data: HiddenSet, lm_head: torch.Tensor,
                       ranks: int = RANKS, chunk: int = 256) -> torch.Tensor:
    """[N, K, ranks] token ids: each head's top-``ranks`` guesses at each position (full vocabulary)."""
    out = []
    for s in range(0, len(data), chunk):
        logits = heads.head_logits(data.hidden[s:s + chunk], lm_head)
        out.append(torch.topk(logits, ranks, dim=-1).indices)
    return torch.cat(out) if out else torch.zeros(0, heads.num_heads, ranks, dtype=torch.long)


def rank_accuracy(top: torch.Tensor, targets: torch.Tensor) -> list[list[float]]:
    """acc[k][i]: fraction of positions where head k's i-th ranked token is the right one."""
    acc = []
    for k in range(targets.shape[1]):
        valid = targets[:, k] != IGNORE
        n = int(valid.sum())
        hits = (top[valid, k, :] == targets[valid, k].unsqueeze(1)).float()
        acc.append([float(x) for x in (hits.sum(0) / max(1, n))])
    return acc


def simulate_greedy(top: torch.Tensor, data: HiddenSet, tree: Sequence[Sequence[int]]) -> dict:
    """Replay greedy verification on the held-out answers: how many candidates each round accepts.

    A round at position t sends the root x[t+1] plus the tree's candidates
    (head d's ranked tokens); a node is accepted when its whole path matches the
    model's own greedy continuation. The round commits the root plus the
    deepest accepted path, so the next round starts at t + 1 + accepted.
    Rounds run while at least one candidate position is left in the answer.
    """
    paths = [tuple(p) for p in tree]
    rounds = accepted = 0
    hist: dict[int, int] = {}
    for start, end in data.spans:
        t = start
        while t < end:
            tgt = data.targets[t]
            ok: dict[tuple[int, ...], bool] = {}
            best = 0
            for p in paths:
                d = len(p) - 1
                good = (d == 0 or ok.get(p[:-1], False)) and int(tgt[d]) != IGNORE \
                    and int(top[t, d, p[-1]]) == int(tgt[d])
                ok[p] = good
                if good:
                    best = max(best, len(p))
            rounds += 1
            accepted += best
            hist[best] = hist.get(best, 0) + 1
            t += 1 + best
    return {"rounds": rounds, "mean_accepted": accepted / rounds if rounds else 0.0,
            "tokens_per_round": (accepted + rounds) / rounds if rounds else 0.0,
            "accepted_histogram": {str(k): v for k, v in sorted(hist.items())}}


def evaluate(heads: MedusaHeads, data: HiddenSet, lm_head: torch.Tensor, max_nodes: int = 64,
             shipped_tree: Sequence[Sequence[int]] | None = None) -> dict:
    """Per-head accuracy on held-out positions, the tree built from it, and simulated acceptance.

    The built tree is chosen from these same positions' accuracies (50 numbers),
    so its replay is slightly optimistic; ``shipped_tree`` (the heads file's
    own tree, chosen at training time) is replayed too when given.
    """
    top = ranked_predictions(heads, data, lm_head)
    acc = rank_accuracy(top, data.targets)
    tree = build_tree(acc, max_nodes=max_nodes)
    chain = chain_tree(heads.num_heads)
    extra = {}
    if shipped_tree is not None:
        extra["shipped_tree"] = {"nodes": len(shipped_tree),
                                 "predicted_accepted": round(expected_accepted(shipped_tree, acc), 3),
                                 **simulate_greedy(top, data, shipped_tree)}
    return {**extra,
        "positions": len(data),
        "top1": [round(a[0], 4) for a in acc],
        "top5": [round(sum(a[:5]), 4) for a in acc],
        "topk_accuracy": [[round(x, 4) for x in a] for a in acc],
        "tree": [list(p) for p in tree],
        "tree_nodes": len(tree),
        "chain": {"nodes": len(chain), "predicted_accepted": round(expected_accepted(chain, acc), 3),
                  **simulate_greedy(top, data, chain)},
        "built_tree": {"nodes": len(tree), "predicted_accepted": round(expected_accepted(tree, acc), 3),
                       **simulate_greedy(top, data, tree)},
    }


__all__ = ["Prompt", "Example", "HiddenSet", "RuntimeCheck", "TrainConfig", "TransformersGenerator",
           "load_prompts", "is_heldout", "chat_prompt_ids", "generate_runtime", "collect_hidden",
           "runtime_hidden", "train_heads", "medusa_loss", "mean_loss", "evaluate", "ranked_predictions",
           "rank_accuracy", "simulate_greedy", "lr_at", "HELDOUT_FRACTION"]
