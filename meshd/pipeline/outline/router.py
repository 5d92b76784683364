"""Should this question be answered in outline mode? A small shipped classifier decides ``outline: "auto"``.

Outline decoding helps answers that are a list of independent points and
hurts everything else (code, maths, step-by-step reasoning, one-line
answers). Asking the embedded 135M model to route itself is unreliable, so a
logistic regression over hashed word uni-/bigrams and a few cues (code
characters, digits and operators, reasoning words, length) decides; it is
trained on ``bench/prompts/outline_router_train.jsonl`` (shipped weights in
``meshd/data/outline_router.json``) and measured on a held-out labelled set
of different questions (``bench/prompts/outline_quality.jsonl``):

    .venv/bin/python -m meshd.pipeline.outline.router train   # rewrite the weights, print accuracy
    .venv/bin/python -m meshd.pipeline.outline.router eval

It errs towards "off": a wrongly refused outline costs speed, a wrongly
granted one costs answer quality.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

DIM = 1 << 12
THRESHOLD = 0.6  # above 0.5: errs towards plain decoding
WEIGHTS = Path(__file__).resolve().parents[2] / "data" / "outline_router.json"
ROOT = Path(__file__).resolve().parents[3]
TRAIN_SET = ROOT / "bench" / "prompts" / "outline_router_train.jsonl"
HELD_OUT = ROOT / "bench" / "prompts" / "outline_quality.jsonl"

_WORD = re.compile(r"[a-z]+|\d+|[^\sa-z\d]")
_CODE = re.compile(r"[{}();=<>\[\]`]|\bdef\b|\bfunction\b|\bclass\b|\bsql\b|\bpython\b|\bbash\b|\bregex|\bscript\b|"
                   r"\bcode\b|\bquery\b|\bjavascript\b|\brust\b|\byaml\b|\bjson\b")
_MATH = re.compile(r"\d\s*[-+*/x^%]\s*\d|\bsolve\b|\bcalculate\b|\bcompute\b|\bhow many\b|\bsum of\b|\bfactori[sz]e\b|"
                   r"\bderivative\b|\bintegrate\b|\barea of\b|\bprobability\b|\bpercent|%")
_STEPS = re.compile(r"step by step|\breason\b|\bprove\b|\bwalk me through\b|\bthink\b")
_LIST = re.compile(r"\bways\b|\btips\b|\bideas\b|\bbenefits\b|\bpros\b|\bcons\b|\bmain\b|\bkey\b|\bwhat would\b|"
                   r"\bwhat if\b|\bhow would\b|\bwhat should\b|\bhabits\b|\bdifferences\b|\bcauses\b|\bhow can\b|"
                   r"\bdescribe\b|\bfeatures\b|\bautomat")


def _bucket(token: str) -> int:
    return int.from_bytes(hashlib.blake2b(token.encode(), digest_size=4).digest(), "little") % (DIM - 16)


def features(text: str) -> np.ndarray:
    """A fixed-size feature vector: hashed uni/bigrams, then 16 hand-made cues at the end."""
    t = text.lower()
    words = _WORD.findall(t)
    v = np.zeros(DIM, dtype=np.float32)
    for w in words:
        v[_bucket("u:" + w)] += 1.0
    for a, b in zip(words, words[1:]):
        v[_bucket(f"b:{a} {b}")] += 1.0
    norm = np.linalg.norm(v[: DIM - 16])
    if norm:
        v[: DIM - 16] /= norm
    n = len(t.split())
    cues = [len(_CODE.findall(t)) > 0, len(_MATH.findall(t)) > 0, len(_STEPS.findall(t)) > 0,
            len(_LIST.findall(t)) > 0, n <= 5, 5 < n <= 9, n > 9, "?" in t, sum(c.isdigit() for c in t) >= 2,
            t.startswith(("write", "fix", "implement", "convert")), t.startswith(("what is", "who", "when", "is ")),
            t.startswith(("turn", "set", "lock", "play", "open", "close", "say")), ":" in t, "\n" in t,
            t.startswith(("what are", "what would", "how would", "how can", "what should")), 1.0]
    v[DIM - 16:] = np.asarray(cues, dtype=np.float32)
    return v


@dataclass(frozen=True)
class Router:
    weights: np.ndarray
    bias: float
    threshold: float = THRESHOLD

    def probability(self, text: str) -> float:
        z = float(features(text) @ self.weights + self.bias)
        return float(1.0 / (1.0 + np.exp(-z)))

    def wants_outline(self, text: str) -> bool:
        return bool(self.probability(text) >= self.threshold)

    def to_json(self, meta: dict) -> dict:
        nz = np.nonzero(self.weights)[0]
        return {"dim": DIM, "bias": self.bias, "threshold": self.threshold,
                "weights": {str(int(i)): round(float(self.weights[i]), 5) for i in nz}, **meta}

    @classmethod
    def from_json(cls, raw: dict) -> "Router":
        if raw.get("dim") != DIM:
            raise ValueError(f"router weights for dimension {raw.get('dim')}, this code uses {DIM}")
        w = np.zeros(DIM, dtype=np.float32)
        for i, x in raw["weights"].items():
            w[int(i)] = x
        return cls(w, float(raw["bias"]), float(raw.get("threshold", THRESHOLD)))


@lru_cache(maxsize=1)
def shipped() -> Router:
    return Router.from_json(json.loads(WEIGHTS.read_text()))


def train(rows: list[dict], epochs: int = 400, lr: float = 0.5, l2: float = 1e-3) -> Router:
    """Class-balanced logistic regression by full-batch gradient descent (deterministic)."""
    x = np.stack([features(r["prompt"]) for r in rows])
    y = np.asarray([1.0 if r["outline"] else 0.0 for r in rows], dtype=np.float32)
    pos = max(y.sum(), 1.0)
    neg = max(len(y) - y.sum(), 1.0)
    sw = np.where(y == 1, len(y) / (2 * pos), len(y) / (2 * neg)).astype(np.float32)
    w = np.zeros(DIM, dtype=np.float32)
    b = 0.0
    for _ in range(epochs):
        p = 1.0 / (1.0 + np.exp(-(x @ w + b)))
        g = (p - y) * sw
        w -= lr * (x.T @ g / len(y) + l2 * w)
        b -= lr * float(g.mean())
    return Router(w, b)


def accuracy(router: Router, rows: list[dict]) -> dict:
    by_cat: dict[str, list[bool]] = {}
    for r in rows:
        by_cat.setdefault(r.get("category", "all"), []).append(router.wants_outline(r["prompt"]) == r["outline"])
    flat = [ok for v in by_cat.values() for ok in v]
    return {"accuracy": round(sum(flat) / len(flat), 3), "n": len(flat),
            "by_category": {c: round(sum(v) / len(v), 3) for c, v in sorted(by_cat.items())}}


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="train or evaluate the outline router")
    ap.add_argument("command", choices=["train", "eval"])
    args = ap.parse_args(argv)
    train_rows, held = _rows(TRAIN_SET), _rows(HELD_OUT)
    if args.command == "train":
        router = train(train_rows)
        meta = {"trained_on": TRAIN_SET.name, "train_examples": len(train_rows),
                "train_accuracy": accuracy(router, train_rows)["accuracy"],
                "held_out": {"set": HELD_OUT.name, **accuracy(router, held)}}
        WEIGHTS.write_text(json.dumps(router.to_json(meta)))
        print(json.dumps(meta, indent=1))
    else:
        print(json.dumps(accuracy(shipped(), held), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
