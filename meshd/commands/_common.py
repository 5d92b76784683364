"""Argument groups shared by commands that run the model."""

from __future__ import annotations

import torch

from decoding.device import DEVICE_CHOICES, DTYPES, WEIGHT_MODES


def add_model_args(p) -> None:
    p.add_argument("--model", default=None,
                   help="GGUF file or Hugging Face directory (default: embedded SmolLM2-135M-Instruct)")
    add_device_args(p)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")


def add_device_args(p, default_device: str = "auto", stages: bool = True) -> None:
    """``--device`` and ``--dtype``. The device is checked (and CUDA asked for) when the command runs,
    so ``--help`` and argument errors never initialise CUDA."""
    per_stage = "; with --stages K, a comma list gives each stage its own (e.g. cuda,cpu)" if stages else ""
    p.add_argument("--device", default=default_device,
                   help=f"where the model runs: {DEVICE_CHOICES} (default {default_device}: "
                        f"{'CUDA when available, else the CPU' if default_device == 'auto' else default_device})"
                        f"{per_stage}")
    p.add_argument("--weights", default="auto", choices=["auto", *WEIGHT_MODES],
                   help="numeric mode (default auto: packed on the CPU - 4-bit matrices, bfloat16 activations - "
                        "bfloat16 on GPUs that have it natively, else float16)")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="older spelling of a dense --weights mode")


def add_sampling_args(p) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)


def sampling_from_args(args):
    from decoding.sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)


def apply_threads(args) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
