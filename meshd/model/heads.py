"""The Medusa heads and early-exit heads shipped for the embedded model, and a cloud verifier's preview heads,
pinned by sha256.

They were trained with ``meshd heads train`` (defaults) on the embedded
SmolLM2-135M-Instruct; the file sits in the package so the quick start drafts
with them without downloading anything. The pin catches a damaged install or
a file swapped after training; ``model_identity`` catches pairing them with a
different model that happens to have the same shapes (heads guess what one
particular model will say, they are useless for another).
"""

from __future__ import annotations

from pathlib import Path

from decoding.errors import DrafterError
from decoding.exits.heads import ExitHeads
from decoding.medusa import MedusaHeads

HEADS_FILE = Path(__file__).parent.parent / "data" / "medusa-smollm2-135m.pt"
HEADS_SHA256 = "5043d2488fa8f4b6153d687fbb8c7f84d998dcff9feaa70d996f5f95f4723cdb"


def embedded_heads(*, vocab_size: int | None = None, hidden_size: int | None = None,
                   model_identity: str | None = None) -> MedusaHeads:
    """Load and verify the shipped heads; ``DrafterError`` says why they cannot be used."""
    heads = MedusaHeads.load(HEADS_FILE, sha256=HEADS_SHA256, vocab_size=vocab_size, hidden_size=hidden_size)
    trained_for = (heads.meta.get("model") or {}).get("identity")
    if model_identity is not None and trained_for is not None and model_identity != trained_for:
        raise DrafterError(f"the shipped Medusa heads were trained for {trained_for}, not {model_identity}; "
                           f"train heads for this model with `meshd heads train --model ...`")
    return heads


# The early-exit heads (``meshd heads train-exits``, defaults) for the same model.
EXITS_FILE = Path(__file__).parent.parent / "data" / "exits-smollm2-135m.pt"
EXITS_SHA256 = "f0954285fda3cc14567fa1c451d6d764951666ac7adc9e3f01bb0d5407ff0e29"


def embedded_exits(*, num_layers: int | None = None, hidden_size: int | None = None, vocab_size: int | None = None,
                   model_identity: str | None = None) -> ExitHeads:
    """Load and verify the shipped exit heads; ``DrafterError`` says why they cannot be used."""
    heads = ExitHeads.load(EXITS_FILE, sha256=EXITS_SHA256, num_layers=num_layers, hidden_size=hidden_size,
                           vocab_size=vocab_size)
    trained_for = (heads.meta.get("model") or {}).get("identity")
    if model_identity is not None and trained_for is not None and model_identity != trained_for:
        raise DrafterError(f"the shipped exit heads were trained for {trained_for}, not {model_identity}; "
                           f"train exit heads for this model with `meshd heads train-exits --model ...`")
    return heads


# Exit heads a cloud verifier previews its verdicts with, by the model they were trained for (its
# ``ModelSource.identity``; the file's meta names it too), pinned. The embedded model's Synera exits serve as
# its preview exits too (any exit may preview). Qwen2.5-Coder-1.5B-Instruct's (the verifier over a 0.5B home):
# ``meshd heads train-exits --model qwen2.5-coder-1.5b-instruct --previews --shortlist 4096`` on 128 of the
# shipped prompts' answers (its held-out agreement per exit is in the file's meta and
# bench/results/issue51/train_exits_1.5b.json).
PREVIEW_FILES = {
    "SmolLM2-135M-Instruct.Q4_1.gguf@b179c9523d0e6a0f": (EXITS_FILE.name, EXITS_SHA256),
    "qwen2.5-coder-1.5b-instruct.gguf@cc324af070c2ecbf": (
        "previews-qwen2.5-coder-1.5b.pt", "cdbe065e065dde2a72ed2337ed729fe8b3ed57eb9330db8301d207dd47bc0b4a"),
}


def preview_heads_for(identity: str, *, num_layers: int, hidden_size: int, vocab_size: int) -> ExitHeads | None:
    """The shipped preview heads trained for the model ``identity`` (a ``ModelSource.identity``), or None.
    Only that model's file is read (a verifier starts without reading the others')."""
    if identity not in PREVIEW_FILES:
        return None
    name, sha = PREVIEW_FILES[identity]
    heads = ExitHeads.load(Path(__file__).parent.parent / "data" / name, sha256=sha, num_layers=num_layers,
                           hidden_size=hidden_size, vocab_size=vocab_size)
    trained_for = (heads.meta.get("model") or {}).get("identity")
    if trained_for != identity:
        raise DrafterError(f"{name} was trained for {trained_for}, not {identity}")
    return heads


__all__ = ["EXITS_FILE", "EXITS_SHA256", "HEADS_FILE", "HEADS_SHA256", "PREVIEW_FILES", "embedded_exits",
           "embedded_heads", "preview_heads_for"]
