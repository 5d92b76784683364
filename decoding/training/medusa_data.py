"""Medusa-1 training data: self-distilled answers and their cached hidden states.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from decoding.errors import DrafterError
from decoding.models.llama import rms_norm

IGNORE = -100  # a target past the end of an answer
HELDOUT_FRACTION = 0.15


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


__all__ = ["HELDOUT_FRACTION", "IGNORE", "Example", "HiddenSet", "Prompt", "RuntimeCheck", "TransformersGenerator",
           "chat_prompt_ids", "collect_hidden", "generate_runtime", "is_heldout", "load_prompts", "runtime_hidden"]
