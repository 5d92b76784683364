"""meshd's logits against transformers' on the same tiny model, in each numeric mode and layout.

One tiny model is checked as a Hugging Face directory and as GGUF files of
several storage types (:class:`TinyFiles`). transformers runs in float32 on the
weights each (file, mode) really holds (:func:`reference_model`): the values
the file stores and, where a packed mode rounds them further (``packed``: wider
than 8-bit codes to 8 bits; ``packed4``: all but 4-bit codes to 4 bits), the
rounded values. What is left between the two is the mode's arithmetic, held to
the distance the existing Llama tests allow it (:data:`TOLERANCE`).

The prompt runs as a mesh runs it: prefilled whole on one device, or cut at a
packed block boundary across two stages, then decoded one token at a time —
so both the long-prompt path (matrices widened) and the row-at-a-time path
(the int4 kernel) of a packed stage are compared.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import torch

from decoding.batch import EXACT_BLOCK
from decoding.loader import open_model
from decoding.pipeline_local import LocalPipeline
from tests.support.gguf_convert import as_stored, write_gguf
from tests.support.tiny_archs import build_model, save_hf_dir

#: Numeric modes meshd ships (``decoding.device.WEIGHT_MODES``): dtype of activations, packing.
MODES: dict[str, tuple[torch.dtype, str]] = {
    "float32": (torch.float32, ""), "bfloat16": (torch.bfloat16, ""), "float16": (torch.float16, ""),
    "packed": (torch.bfloat16, "packed"), "packed4": (torch.bfloat16, "packed4")}

#: Largest logit distance from transformers float32, per mode: the bounds the Llama tests hold
#: (tests/decoding/test_runtime_matches_transformers.py, test_runtime_dtypes.py); the packed modes
#: compute in bfloat16 on the weights they hold, so they get bfloat16's. Observed on these tiny
#: models: ~1e-6, ~0.02, ~0.003, ~0.03, ~0.02.
TOLERANCE = {"float32": 1e-3, "bfloat16": 0.25, "float16": 0.05, "packed": 0.25, "packed4": 0.25}

#: Where a model is read from: its Hugging Face directory, or a GGUF with matrices of this type.
SOURCES = ("hf", "F16", "Q8_0", "Q4_0")

PROMPT, DECODE = EXACT_BLOCK + 8, 4  # a prompt a 2-stage mesh cuts at a packed block, then decode steps


def token_ids(vocab: int, seed: int = 3) -> list[int]:
    return torch.randint(0, vocab, (PROMPT + DECODE,), generator=torch.Generator().manual_seed(seed)).tolist()


@dataclass
class TinyFiles:
    """One tiny model of ``kind`` (tests/support/tiny_archs.py), saved in every source format."""

    kind: str
    model: object
    paths: dict[str, Path]
    _refs: dict = field(default_factory=dict)

    @classmethod
    def write(cls, kind: str, root: Path, seed: int = 0) -> "TinyFiles":
        model = build_model(kind, seed)
        paths = {"hf": save_hf_dir(model, root / "hf")}
        for matrices in SOURCES[1:]:
            paths[matrices] = write_gguf(model, root / f"tiny-{kind}-{matrices}.gguf", matrices)
        return cls(kind, model, paths)

    def reference_logits(self, source: str, mode: str, ids: list[int]) -> torch.Tensor:
        """transformers' float32 logits over ``ids`` with the weights ``mode`` holds when reading ``source``."""
        key = (source, _rounding(source, mode), tuple(ids))
        if key not in self._refs:
            ref = reference_model(self.model, source, mode)
            with torch.no_grad():
                self._refs[key] = ref(torch.tensor([ids])).logits[0].float()
        return self._refs[key]


def _rounding(source: str, mode: str) -> str:
    """How ``mode`` rounds ``source``'s matrices beyond what the file stores: "", "8bit" or "4bit"."""
    if mode == "packed" and source in ("hf", "F16"):
        return "8bit"
    if mode == "packed4" and source != "Q4_0":
        return "4bit"
    return ""


def reference_model(model, source: str, mode: str):
    """A copy of ``model`` holding the values meshd's ``mode`` multiplies by when it reads ``source``.

    A packed stage keeps an untied token embedding as the file stores it (rows widened per lookup)
    and packs every other matrix; a tied one embeds with the packed head's rows.
    """
    from decoding.quant.groups import requantize, requantize_8bit

    stored = as_stored(model, "F32" if source == "hf" else source)
    rounding = _rounding(source, mode)
    if not rounding:
        return stored
    ref = copy.deepcopy(stored)
    embed = ref.get_input_embeddings().weight
    tied = ref.config.tie_word_embeddings
    with torch.no_grad():
        for p in ref.parameters():
            if p.dim() != 2 or (p is embed and not tied):
                continue
            w = p.detach()
            if rounding == "4bit":
                p.copy_(requantize(w).dequantize())
            else:
                hi, lo = requantize_8bit(w)
                p.copy_(hi.dequantize() + lo.dequantize())
    return ref.eval()


def meshd_logits(path: Path, mode: str, stages: int, ids: list[int]) -> torch.Tensor:
    """meshd's logits for every position of ``ids``: ``stages`` even stages (LocalPipeline), the prompt
    ``ids[:PROMPT]`` prefilled (cut at EXACT_BLOCK across two stages), then one decode step per token."""
    dtype, packing = MODES[mode]
    pipe = LocalPipeline.from_source(open_model(path), stages, dtype, packed=packing)
    pipe.create("s", len(ids))
    chunks = [ids[:PROMPT]] if stages == 1 else [ids[:EXACT_BLOCK], ids[EXACT_BLOCK:PROMPT]]
    chunks += [[t] for t in ids[PROMPT:]]
    return torch.cat([pipe.forward("s", torch.tensor(c), all_logits=True).float() for c in chunks])


def assert_equals_transformers(files: "TinyFiles", source: str, mode: str) -> None:
    """meshd's logits for ``files`` read from ``source`` in ``mode`` equal transformers' within the mode's
    tolerance, on one device and on 2 stages; a packed mode's 2 stages equal its one device bit for bit
    (a prompt cut at a block boundary is computed as one device computes it)."""
    ids = token_ids(files.model.config.vocab_size)
    want = files.reference_logits(source, mode, ids)
    one = meshd_logits(files.paths[source], mode, 1, ids)
    two = meshd_logits(files.paths[source], mode, 2, ids)
    assert (one - want).abs().max().item() < TOLERANCE[mode]
    assert (two - want).abs().max().item() < TOLERANCE[mode]
    if MODES[mode][1]:
        assert torch.equal(two, one)


def logits_after_cuts(stage, ids, cuts: list[int], decode_steps: int) -> torch.Tensor:
    """The last row's logits of a prompt fed to ``stage`` in pieces ending at ``cuts``, then of
    ``decode_steps`` greedy steps: an exact mode gives the uncut prompt's bits whatever the cuts."""
    kv = stage.new_cache(1024)
    kv.create("s", 16)
    start, rows = 0, []
    for end in [*cuts, len(ids)]:
        rows.append(stage.forward(kv, "s", ids[start:end])[-1])
        start = end
    x = rows[-1].argmax().view(1)
    for _ in range(decode_steps):
        rows.append(stage.forward(kv, "s", x)[-1])
        x = rows[-1].argmax().view(1)
    return torch.stack(rows[-(decode_steps + 1):])


def steps_and_round(stage, prompt: torch.Tensor, more: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of ``more`` after ``prompt`` computed as decode steps one by one, and as one verify round:
    an exact mode gives the two the same bits."""
    kv = stage.new_cache(512)
    for seq in ("one", "all"):
        kv.create(seq, 64)
        stage.forward(kv, seq, prompt, all_logits=False)
    steps = torch.cat([stage.forward(kv, "one", more[i:i + 1]) for i in range(len(more))])
    return steps, stage.forward(kv, "all", more)


def disagreements_at_clear_choices(source, reference_stage, stage, margin: float = 0.05) -> tuple[list[int], int, int]:
    """Teacher-forced over ``reference_stage``'s own greedy answer to a short chat question: the answer
    positions where the reference's top two tokens are more than ``margin`` apart and ``stage`` picks
    another token, how many clear positions there were (near-ties may flip by rounding), and the
    answer's length."""
    from decoding.generate import generate

    tok = source.tokenizer
    ids = tok.apply_chat([{"role": "user", "content": "What is the capital of France?"}])
    answer = generate(LocalPipeline([reference_stage]), ids, 16, eos_ids=tok.eos_ids).token_ids
    seq = torch.tensor(ids + answer)
    logits = []
    for st in (reference_stage, stage):
        kv = st.new_cache(128)
        kv.create("s", len(seq))
        logits.append(st.forward(kv, "s", seq)[len(ids) - 1:].float())
    top2 = torch.softmax(logits[0], -1).topk(2).values
    clear = (top2[:, 0] - top2[:, 1]) > margin
    agree = logits[1].argmax(-1) == logits[0].argmax(-1)
    return (~agree & clear).nonzero().flatten().tolist(), int(clear.sum()), len(answer)
