"""Where a stage computes: ``--device auto|cpu|cuda|cuda:N`` and the dtype that goes with it.

Why a module of its own: every entry point (``meshd join``, ``generate``,
``profile``, the stage processes, the benchmarks) must read the same strings the
same way and fail with the same one-line errors, and the runtime needs one rule
for what crosses between host and device:

- weights, the KV cache, masks, positions and RoPE tables live on the stage's
  device (every tensor factory in the forward path is given ``device=``);
- token ids, hidden states and tree masks arrive on the host and are moved to
  the device once per message, inside the forward;
- what a stage hands out (logits, hidden states) is moved back to the host once
  per message by whoever called the forward (the stage service's compute
  thread, ``LocalPipeline``), so sampling, penalties, grammars and the transport
  only ever see host tensors — and a seeded sampler draws the same tokens from
  the same probabilities whichever device computed the logits.

On the CPU none of these moves happen at all (callers test ``is_host`` once,
outside their loops), so the CPU path pays nothing for the device option.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from decoding.errors import DeviceError

CPU = torch.device("cpu")

#: The runtime dtypes a stage may hold its weights and KV cache in, by CLI name.
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: Packed numeric modes (CPU; ``decoding.quant``): ``packed`` keeps every code of the file (4-bit
#: tensors as 4-bit groups, wider ones as 8-bit groups) with bfloat16 activations; ``packed4`` makes
#: every matrix 4-bit, rounding the wider ones (smaller and faster, at a measured cost in quality);
#: ``gguf`` multiplies the file's own blocks, mapped, against int8-quantised float32 activations
#: (``decoding.quant.blocks``: llama.cpp's arithmetic, for CPUs without a bfloat16 unit).
PACKINGS = ("packed", "packed4", "gguf")
#: The activation dtype of each packed mode.
PACKING_DTYPES = {"packed": torch.bfloat16, "packed4": torch.bfloat16, "gguf": torch.float32}
#: Numeric modes, by CLI name: a dense dtype or a packing.
WEIGHT_MODES = (*DTYPES, *PACKINGS)
WEIGHTS_CHOICES = "auto, " + ", ".join(WEIGHT_MODES)

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
DTYPE_CHOICES = "auto, " + ", ".join(DTYPES)
_DEVICE_RE = re.compile(r"auto|cpu|cuda(?::(\d+))?")


def check_device_spec(spec: str | None) -> str:
    """The normalised spelling of a ``--device`` value, checked without touching CUDA (for config files)."""
    text = "auto" if spec is None else str(spec).strip().lower()
    if not _DEVICE_RE.fullmatch(text):
        raise DeviceError(f"--device must be {DEVICE_CHOICES}, got {spec!r}")
    return text


def check_dtype_spec(spec: str | None) -> str:
    """The normalised spelling of a ``--dtype`` value ("auto": the device's default)."""
    text = "auto" if spec is None else str(spec).strip().lower()
    if text != "auto" and text not in DTYPES:
        raise DeviceError(f"--dtype must be {DTYPE_CHOICES}, got {spec!r}")
    return text


def check_weights_spec(spec: str | None) -> str:
    """The normalised spelling of a ``--weights`` value ("auto": the fastest faithful mode of the device)."""
    text = "auto" if spec is None else str(spec).strip().lower()
    if text != "auto" and text not in WEIGHT_MODES:
        raise DeviceError(f"--weights must be {WEIGHTS_CHOICES}, got {spec!r}")
    return text


def resolve_weights(spec: str | None, device: torch.device) -> tuple[torch.dtype, str]:
    """``--weights``: (the dtype of activations and the KV cache, the packing of matrices or "").

    ``auto`` on a CPU is :func:`default_cpu_mode` (``packed`` with a bfloat16 unit, else
    ``gguf``; a daemon replaces it with the mode it measured fastest), elsewhere the
    device's default dtype. The packed modes are CPU-only.
    """
    text = check_weights_spec(spec)
    if text in DTYPES:
        return DTYPES[text], ""
    if device.type != "cpu":
        if text in PACKINGS:
            raise DeviceError(f"--weights {text} runs on the CPU only; on {device} use bfloat16 or float16")
        return default_dtype(device), ""
    if text == "auto":
        text = default_cpu_mode()
        return (PACKING_DTYPES[text], text) if text in PACKINGS else (DTYPES[text], "")
    ok, why = mode_available(text)
    if not ok:
        raise DeviceError(f"--weights {text}: {why}")
    return PACKING_DTYPES[text], text


def mode_available(mode: str) -> tuple[bool, str]:
    """(this CPU can compute ``mode``, why not): the packed modes need torch's int4 kernel, ``gguf``
    the integer kernels built (``decoding.quant.native``); the dense ones always work."""
    if mode in ("packed", "packed4"):
        from decoding.quant.packed import INT4_OK, INT4_UNAVAILABLE

        return INT4_OK, INT4_UNAVAILABLE
    if mode == "gguf":
        from decoding.quant import native

        return native.available()
    return True, ""


def has_bfloat16_unit(flags: set[str] | None = None) -> bool:
    """Whether the CPU multiplies bfloat16 in hardware (AMX or AVX-512 BF16 on x86, BF16 on ARM):
    where it does not, bfloat16 is emulated and the packed mode loses to the integer kernels."""
    if flags is None:
        from decoding.quant.native import cpu_flags

        flags = cpu_flags()
    return bool(flags & {"amx_bf16", "avx512_bf16", "bf16"})


def default_cpu_mode() -> str:
    """``--weights auto`` on a CPU before this device has timed its modes (the profile's choice wins
    once measured; ``meshd.model.self_profile``): ``packed`` where a bfloat16 unit makes it fast,
    else the integer kernels, else float32."""
    if has_bfloat16_unit() and mode_available("packed")[0]:
        return "packed"
    if mode_available("gguf")[0]:
        return "gguf"
    return "packed" if mode_available("packed")[0] else "float32"


def _no_cuda_reason() -> str:
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is a CPU-only build; install a CUDA build (README: GPU installs)"
    return ("torch.cuda.is_available() is False (no GPU visible to this process: a sandbox such as systemd's "
            "PrivateDevices hides it, or its driver is not loaded)")


def resolve_device(spec: str | torch.device | None = "auto") -> torch.device:
    """``auto`` (CUDA when available, else the CPU), ``cpu``, ``cuda`` (= ``cuda:0``) or ``cuda:N``.

    CUDA devices always carry their index: ``torch.device("cuda") != torch.device("cuda:0")``,
    and tensors report the indexed form, so comparisons must use it too.
    """
    text = check_device_spec(str(spec) if isinstance(spec, torch.device) else spec)
    if text == "cpu":
        return CPU
    if text == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else CPU
    if not torch.cuda.is_available():
        raise DeviceError(f"--device {text}: no CUDA device available: {_no_cuda_reason()}")
    index = int(text.partition(":")[2] or 0)
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceError(f"--device {text}: this machine has {count} CUDA device(s) (cuda:0..cuda:{count - 1})")
    return torch.device("cuda", index)


def resolve_devices(spec: str | None, stages: int) -> list[torch.device]:
    """One device per in-process stage: a single value for all, or a comma list of ``stages`` values."""
    parts = ("auto" if spec is None else str(spec)).split(",")
    if len(parts) == 1:
        return [resolve_device(parts[0])] * stages
    if len(parts) != stages:
        raise DeviceError(f"--device lists {len(parts)} devices for {stages} stage(s); give one, or one per stage")
    return [resolve_device(p) for p in parts]


def default_dtype(device: torch.device) -> torch.dtype:
    """float32 on the CPU; on a GPU bfloat16 where it is native (compute capability 8.0+:
    Ampere, Hopper, Jetson Orin), else float16 (Volta/Turing, Jetson Xavier, TX2, Nano).

    ``torch.cuda.is_bf16_supported()`` is not used: it also says yes where bfloat16 is only
    emulated, which is slower than float16 there.
    """
    if device.type != "cuda":
        return torch.float32
    major, _ = torch.cuda.get_device_capability(device)
    return torch.bfloat16 if major >= 8 else torch.float16


def resolve_dtype(spec: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``--dtype``: a name from :data:`DTYPES`, or auto/None for the device's default."""
    if isinstance(spec, torch.dtype):
        if spec not in DTYPES.values():
            raise DeviceError(f"--dtype must be {DTYPE_CHOICES}, got {spec}")
        return spec
    text = check_dtype_spec(spec)
    return default_dtype(device) if text == "auto" else DTYPES[text]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Placement:
    """A resolved device, the dtype a stage computes and keeps its KV cache in there, and whether its
    matrices are packed 4-bit groups (the numeric mode, :attr:`mode`)."""

    device: torch.device
    dtype: torch.dtype
    packed: str = ""  # the packing of its matrices (PACKINGS), "" for dense

    @classmethod
    def resolve(cls, device: str | torch.device | None = "auto", dtype: str | torch.dtype | None = None,
                weights: str | None = None) -> "Placement":
        """``weights`` is the numeric mode (``--weights``); ``dtype`` the older ``--dtype``, which names a
        dense mode. Only an explicit ``--dtype`` with ``--weights`` left at auto still decides."""
        dev = resolve_device(device)
        mode = check_weights_spec(weights)
        legacy = dtype if isinstance(dtype, torch.dtype) else check_dtype_spec(dtype)
        if legacy != "auto":
            if mode not in ("auto", dtype_name(resolve_dtype(legacy, dev))):
                raise DeviceError(f"--dtype {dtype_name(resolve_dtype(legacy, dev))} contradicts --weights {mode}; "
                                  f"give only --weights")
            return cls(dev, resolve_dtype(legacy, dev))
        return cls(dev, *resolve_weights(mode, dev))

    @property
    def mode(self) -> str:
        """The numeric mode's name: ``packed`` or the dense dtype."""
        return self.packed or dtype_name(self.dtype)

    def describe(self) -> dict:
        """What was measured or served on: for logs, status and profiles."""
        return describe_device(self.device) | {"dtype": dtype_name(self.dtype), "weights": self.mode}


def describe_device(device: torch.device) -> dict:
    """``kind`` (cpu/cuda), ``device`` and, on a GPU, its name, capability, memory and whether it is
    integrated (a Jetson: the GPU shares the host's memory, so host and device budgets are one)."""
    out: dict = {"kind": device.type, "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out |= {"name": props.name, "capability": f"{props.major}.{props.minor}",
                "memory_bytes": int(props.total_memory), "integrated": bool(getattr(props, "is_integrated", False))}
    return out


def is_host(device: torch.device) -> bool:
    return device.type == "cpu"


def to_host(x):
    """A stage's output (a tensor, or a tuple/list of them) on the CPU; host tensors are returned as they are."""
    if isinstance(x, torch.Tensor):
        return x if x.device.type == "cpu" else x.cpu()
    if isinstance(x, tuple):
        return tuple(to_host(t) for t in x)
    if isinstance(x, list):
        return [to_host(t) for t in x]
    return x


__all__ = ["CPU", "DTYPES", "PACKINGS", "PACKING_DTYPES", "default_cpu_mode", "has_bfloat16_unit", "mode_available", "WEIGHT_MODES", "WEIGHTS_CHOICES", "check_weights_spec", "resolve_weights",
           "DeviceError", "Placement", "check_device_spec", "check_dtype_spec", "default_dtype",
           "describe_device", "dtype_name", "is_host", "resolve_device", "resolve_devices", "resolve_dtype",
           "to_host"]


def served_reference_stage(source):
    """The whole model as one CPU stage in the numeric mode a daemon serves in by default (``--weights
    auto``: packed where torch's int4 kernel works), warmed up as a daemon is before it serves (a
    process's very first packed forward has been seen to differ in the last bits, with two torch
    threads): the reference a mesh's greedy answers must equal, for the tests and benchmarks alike."""
    p = Placement.resolve("cpu")
    stage = source.load_stage(0, source.config.num_layers, p.dtype, packed=p.packed)
    kv = stage.new_cache(64)
    kv.create("warm-up", 8)
    stage.forward(kv, "warm-up", torch.tensor([1, 2, 3]))
    return stage
