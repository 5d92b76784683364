"""Distance of a numeric mode from float32: perplexity on the shipped text and teacher-forced greedy
agreement with float32, per position (``bench/peers.py``; issue #46 asks it of every mode)."""

from __future__ import annotations

import math
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIDELITY_TEXT = ROOT / "tests" / "data" / "fidelity.txt"


def fidelity(path: Path, modes: list[str], window: int = 512) -> dict:
    """Perplexity of each mode on the shipped text, and its greedy (teacher-forced) agreement with float32."""
    import torch

    from decoding.device import resolve_weights
    from decoding.loader import open_model

    src = open_model(path)
    ids = torch.tensor(src.tokenizer.encode(FIDELITY_TEXT.read_text()))
    out, ref_top = {}, None
    for mode in ["float32", *[m for m in modes if m != "float32"]]:
        dtype, packing = resolve_weights(mode, torch.device("cpu"))
        stage = src.load_stage(0, src.config.num_layers, dtype, packed=packing)
        nll, tops = 0.0, []
        for start in range(0, len(ids) - 1, window):
            chunk = ids[start:start + window + 1]
            kv = stage.new_cache(window + 8)
            kv.create("f", window + 8)
            logits = stage.forward(kv, "f", chunk[:-1]).float()
            nll += float(torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="sum"))
            tops.append(logits.argmax(-1))
        top = torch.cat(tops)
        if mode == "float32":
            ref_top = top
        out[mode] = {"perplexity": math.exp(nll / (len(ids) - 1)),
                     "top1_agreement": float((top == ref_top).float().mean())}
        del stage
    base = out["float32"]["perplexity"]
    for mode, row in out.items():
        row["perplexity_gap"] = row["perplexity"] / base - 1.0
    return {"tokens": int(len(ids)), "modes": out}
