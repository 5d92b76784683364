"""Argument groups shared by commands that run the model."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_model_args(p) -> None:
    p.add_argument("--model", default=None,
                   help="GGUF file or Hugging Face directory (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")


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
