"""The Llama family's flags: which architectures share its block, and how each file format spells them.

Llama, Mistral and Qwen2 share the block (RMSNorm, RoPE, GQA, SwiGLU). Qwen2
differs only by q/k/v biases; Mistral by an optional sliding window, which we
do not implement (we refuse contexts beyond it rather than be wrong). Whether
the head is tied to the embedding and whether there are q/k/v biases is read
from what the file holds as well as from what its metadata says.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Container
from pathlib import Path

from decoding.config import ModelConfig

#: GGUF ``general.architecture`` values this family runs.
GGUF_ARCHS = ("llama", "mistral", "qwen2")
#: Hugging Face ``model_type`` -> architecture.
HF_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}
#: Architectures whose GGUF q/k rows llama.cpp permuted for its interleaved RoPE.
GGUF_PERMUTED = ("llama", "mistral")


def config_from_gguf(arch: str, field: Callable, tensors: Container[str], embed_rows: int) -> ModelConfig:
    """The config of a GGUF file: ``field(key, default)`` reads its metadata, ``tensors`` holds the
    canonical names it stores, ``embed_rows`` is the token embedding's row count."""
    g = lambda k, d=None: field(f"{arch}.{k}", d)  # noqa: E731
    n_heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    head_dim = int(g("attention.key_length", hidden // n_heads))
    scaling = None
    st = g("rope.scaling.type")
    if st and st != "none":
        scaling = {"type": st, "factor": float(g("rope.scaling.factor", 1.0))}
    eos = field("tokenizer.ggml.eos_token_id")
    vocab = int(g("vocab_size", embed_rows))
    return ModelConfig(
        arch=arch, vocab_size=vocab, hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length")), num_layers=int(g("block_count")),
        num_heads=n_heads, num_kv_heads=int(g("attention.head_count_kv", n_heads)),
        head_dim=head_dim, rope_theta=float(g("rope.freq_base", 10000.0)), rope_scaling=scaling,
        rms_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position=int(g("context_length", 2048)),
        tie_embeddings="lm_head" not in tensors,
        attention_bias="layers.0.q_bias" in tensors,
        sliding_window=None,
        bos_id=field("tokenizer.ggml.bos_token_id"),
        eos_ids=(int(eos),) if eos is not None else (),
    )


def config_from_hf(arch: str, raw: dict, tensors: Container[str], directory: Path) -> ModelConfig:
    """The config of a Hugging Face directory: ``raw`` is its config.json, ``tensors`` the canonical
    names its safetensors hold; ``generation_config.json`` there overrides the end-of-sequence ids."""
    r = raw
    n_heads = int(r["num_attention_heads"])
    hidden = int(r["hidden_size"])
    eos = r.get("eos_token_id")
    gen = directory / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id", eos)
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    sliding = r.get("sliding_window") if r.get("use_sliding_window", arch == "mistral") else None
    return ModelConfig(
        arch=arch, vocab_size=int(r["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(r["intermediate_size"]), num_layers=int(r["num_hidden_layers"]),
        num_heads=n_heads, num_kv_heads=int(r.get("num_key_value_heads") or n_heads),
        head_dim=int(r.get("head_dim") or hidden // n_heads),
        rope_theta=float(r.get("rope_theta", (r.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
        rope_scaling=hf_rope_scaling(r),
        rms_eps=float(r.get("rms_norm_eps", 1e-5)),
        max_position=int(r.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(r.get("tie_word_embeddings", False)) or "lm_head" not in tensors,
        attention_bias=bool(r.get("attention_bias", arch == "qwen2")) and "layers.0.q_bias" in tensors,
        sliding_window=int(sliding) if sliding else None,
        bos_id=r.get("bos_token_id"), eos_ids=eos_ids,
    )


def hf_rope_scaling(raw: dict) -> dict | None:
    """A config.json's RoPE scaling, None for plain RoPE.

    Checkpoints on the Hub spell it ``rope_scaling`` (Llama 3.1/3.2's
    ``{"rope_type": "llama3", ...}``); transformers 5 saves ``rope_parameters``
    instead, the scaling and ``rope_theta`` in one dict. Missing it would
    silently run a ``llama3`` checkpoint with unscaled frequencies.
    """
    scaling = raw.get("rope_scaling")
    if scaling:
        return dict(scaling)
    params = {k: v for k, v in (raw.get("rope_parameters") or {}).items() if k != "rope_theta"}
    if (params.get("rope_type") or params.get("type")) in (None, "default"):
        return None
    return params
