"""Which numeric mode this CPU serves in: timed once per model and CPU, not assumed.

Why: the fastest exact mode depends on the CPU more than on anything we can read from it. With AMX a
bfloat16 matrix unit makes the packed mode fast; on an AVX2 mini PC or an ARM board bfloat16 is
emulated and the GGUF blocks' integer kernels win by several times; a CPU where neither kernel
builds or loads still has float32. Reading flags gives a first guess (``decoding.device.
default_cpu_mode``); this module measures, at first start, one decoder layer of the model in each
mode the device has, and the daemon serves in the fastest (``--weights auto`` only; an explicit
mode is never second-guessed). The result is kept in the state directory, keyed by the model, the
CPU and torch, and shown by ``meshd status`` with the timings that decided it.

The cost compared is one typical home request: a 200-token prompt and 50 generated tokens, from
one layer's prefill-chunk and decode-step times (both matter: a Home Assistant turn is mostly
prompt, a chat answer mostly decode).
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from meshd.log import get_logger

log = get_logger("meshd.model.mode_choice")

CANDIDATES = ("gguf", "packed", "float32")  # the exact modes (packed4 rounds weights: never chosen for you)
PROMPT_TOKENS, DECODE_TOKENS = 200, 50  # the request the modes are priced on
CHUNK = 64  # rows of the timed prefill chunk
CHOICE_FILE = "mode-choice.json"


@dataclass(frozen=True)
class ModeTiming:
    mode: str
    decode_s: float  # one layer, one decode step
    prefill_s: float  # one layer, a CHUNK-row prompt chunk

    @property
    def request_s(self) -> float:
        """One layer's share of the priced request."""
        return DECODE_TOKENS * self.decode_s + PROMPT_TOKENS / CHUNK * self.prefill_s


@dataclass(frozen=True)
class ModeChoice:
    mode: str
    how: str  # "measured", "reused" or "flags: <why not measured>"
    timings: tuple[ModeTiming, ...] = ()
    skipped: dict[str, str] = field(default_factory=dict)  # mode -> why it was not timed

    def describe(self) -> str:
        """One line for ``meshd status``: the mode, and the timings that chose it."""
        if not self.timings:
            return f"{self.mode} ({self.how})"
        best = min(t.request_s for t in self.timings)
        rest = ", ".join(f"{t.mode} {t.request_s / best:.2f}x" for t in sorted(self.timings, key=lambda t: t.request_s))
        return f"{self.mode} ({self.how}: request time per layer {rest})"

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "how": self.how, "timings": [asdict(t) for t in self.timings],
                "skipped": dict(self.skipped)}

    @classmethod
    def from_json(cls, d: dict[str, Any], how: str) -> "ModeChoice":
        return cls(str(d["mode"]), how, tuple(ModeTiming(**t) for t in d.get("timings", [])),
                   dict(d.get("skipped", {})))


def machine_key(model: str) -> str:
    """What a choice holds for: the model, the CPU (model name and flags) and torch's version."""
    import torch

    from partition.machine import cpu_flags, cpu_name

    text = "|".join([model, platform.machine(), cpu_name(), " ".join(cpu_flags()), torch.__version__])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def time_mode(source, mode: str, threads: int = 1, repeats: int = 5) -> ModeTiming:
    """One decoder layer of ``source`` in ``mode``: the best of ``repeats`` decode steps and of a few
    CHUNK-row prefill chunks (after one of each to warm the kernels up)."""
    import torch

    from decoding.device import CPU, resolve_weights

    dtype, packing = resolve_weights(mode, CPU)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # a middle layer, fed hidden states: the embedding lookup and the head are not the mode's cost
        layer = min(1, source.config.num_layers - 1)
        stage = source.load_stage(layer, layer + 1, dtype, packed=packing)
        kv = stage.new_cache(CHUNK * 4 + repeats + 8)
        gen = torch.Generator().manual_seed(0)
        rows = torch.randn(CHUNK, source.config.hidden_size, generator=gen).to(dtype)
        if layer == 0:
            rows = torch.arange(1, CHUNK + 1) % source.config.vocab_size

        def run(seq: str, x: torch.Tensor) -> float:
            t0 = time.perf_counter()
            stage.forward(kv, seq, x)
            return time.perf_counter() - t0

        prefill = []
        for i in range(3):
            kv.create(f"p{i}", CHUNK)
            prefill.append(run(f"p{i}", rows))
            kv.free(f"p{i}")
        kv.create("d", repeats + 2)
        decode = [run("d", rows[:1]) for _ in range(repeats + 1)]
        return ModeTiming(mode, min(decode[1:]), min(prefill[1:]))
    finally:
        torch.set_num_threads(before)


def choose(source, threads: int = 1, candidates: tuple[str, ...] = CANDIDATES, timer=time_mode) -> ModeChoice:
    """Time every candidate this CPU can compute and pick the cheapest priced request."""
    from decoding.device import mode_available

    timings, skipped = [], {}
    for mode in candidates:
        ok, why = mode_available(mode)
        if not ok:
            skipped[mode] = why.splitlines()[0][:200] if why else "unavailable"
            continue
        try:
            timings.append(timer(source, mode, threads))
        except Exception as exc:  # noqa: BLE001 - a mode that fails here is a mode not to serve in
            skipped[mode] = f"{type(exc).__name__}: {exc}"[:200]
    if not timings:
        return ModeChoice("float32", "no mode could be timed", (), skipped)
    best = min(timings, key=lambda t: t.request_s)
    return ModeChoice(best.mode, "measured", tuple(timings), skipped)


def settle(state, source, threads: int = 1, chooser=choose) -> ModeChoice:
    """This device's choice for ``source``: the one kept for this model and CPU, else measured now and
    kept (blocking: run it in a worker thread)."""
    key = machine_key(getattr(source, "identity", "") or str(getattr(source, "path", "")))
    path = state.root / CHOICE_FILE
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        kept = {}
    if isinstance(kept, dict) and isinstance(kept.get(key), dict):
        from decoding.device import mode_available

        try:
            choice = ModeChoice.from_json(kept[key], "reused")
        except (KeyError, TypeError, ValueError):
            choice = None
        # a kept mode this machine can no longer compute (kernels gone, no compiler since an upgrade)
        # is measured again rather than failing the model's load
        if choice is not None and mode_available(choice.mode)[0]:
            return choice
    t0 = time.perf_counter()
    choice = chooser(source, threads)
    log.info("numeric_mode_chosen", mode=choice.mode, seconds=round(time.perf_counter() - t0, 1),
             timings={t.mode: {"decode_ms": round(t.decode_s * 1e3, 2), "prefill_ms": round(t.prefill_s * 1e3, 1)}
                      for t in choice.timings}, skipped=choice.skipped)
    if choice.timings:
        from meshd.state import atomic_write

        kept = kept if isinstance(kept, dict) else {}
        kept[key] = choice.to_json()
        atomic_write(path, (json.dumps(kept, indent=2, sort_keys=True) + "\n").encode())
    return choice
