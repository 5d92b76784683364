"""Distance of a numeric mode from float32: perplexity on the shipped text and teacher-forced greedy
agreement with float32, per position (``bench/peers.py``; issue #46 asks it of every mode)."""

from __future__ import annotations

import math
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIDELITY_TEXT = ROOT / "tests" / "data" / "fidelity.txt"


def fidelity(path: Path, modes: list[str], window: int = 512) -> dict:
    """Perplexity of each mode on the shipped text, and its greedy (teacher-forced) agreement with float32.
    A mode "tensorN:split" or "tensorN:whole" is the gguf mode split over an N-member group (in one process,
    bit for bit what N devices compute), holding the attention that way; it also reports its agreement with
    one gguf device."""
    import torch

    from decoding.device import resolve_weights
    from decoding.loader import open_model

    src = open_model(path)
    ids = torch.tensor(src.tokenizer.encode(FIDELITY_TEXT.read_text()))
    chunks = [ids[start:start + window + 1] for start in range(0, len(ids) - 1, window)]
    out, tops = {}, {}
    for mode in ["float32", *[m for m in modes if m != "float32"]]:
        group = mode.startswith("tensor")
        dtype, packing = resolve_weights("gguf" if group else mode, torch.device("cpu"))
        stage = src.load_stage(0, src.config.num_layers, dtype, packed=packing)
        if group:
            from tests.support.tensor_group import group_logits

            size, attention = mode.removeprefix("tensor").split(":")
            every = group_logits(stage, int(size), [c[:-1] for c in chunks], attention=attention)
        else:
            every = []
            for chunk in chunks:
                kv = stage.new_cache(window + 8)
                kv.create("f", window + 8)
                every.append(stage.forward(kv, "f", chunk[:-1]).float())
        nll = sum(float(torch.nn.functional.cross_entropy(lg, c[1:], reduction="sum")) for lg, c in zip(every, chunks))
        tops[mode] = torch.cat([lg.argmax(-1) for lg in every])
        out[mode] = {"perplexity": math.exp(nll / (len(ids) - 1)),
                     "top1_agreement": float((tops[mode] == tops["float32"]).float().mean())}
        if group and "gguf" in tops:
            out[mode]["top1_agreement_one_device"] = float((tops[mode] == tops["gguf"]).float().mean())
        del stage
    base = out["float32"]["perplexity"]
    for mode, row in out.items():
        row["perplexity_gap"] = row["perplexity"] / base - 1.0
    return {"tokens": int(len(ids)), "modes": out}
