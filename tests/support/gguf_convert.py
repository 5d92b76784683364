"""A transformers model written as GGUF the way llama.cpp's convert_hf_to_gguf.py writes it.

The tiny random models of tests/support/tiny_archs.py are checked against
transformers as Hugging Face directories and as GGUF files; this is the second
half. It writes what the converter does for the Llama family and Qwen3: the
``{arch}.*`` metadata (``attention.key_length`` where the config names a
head_dim), Llama's q/k rows permuted for llama.cpp's interleaved RoPE (Qwen2/3
are not), no ``output.weight`` when the head is tied, and a Llama 3 ``llama3``
RoPE scaling as a ``rope_freqs`` tensor of per-frequency divisors (llama.cpp
has no ``llama3`` scaling type in its metadata).

Matrices may be stored quantised (``F16``, ``Q8_0``, ``Q4_0``; norms stay
F32, as the converter keeps them). :func:`as_stored` gives transformers the
weights the file really holds, so a quantised file is compared with exactly
its own values.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import torch

#: Storage types a tiny file's matrices may take.
MATRIX_TYPES = ("F32", "F16", "Q8_0", "Q4_0")

_LAYER = {"input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "attn_q",
          "self_attn.k_proj.weight": "attn_k", "self_attn.v_proj.weight": "attn_v",
          "self_attn.o_proj.weight": "attn_output", "post_attention_layernorm.weight": "ffn_norm",
          "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up", "mlp.down_proj.weight": "ffn_down",
          "self_attn.q_proj.bias": "attn_q", "self_attn.k_proj.bias": "attn_k", "self_attn.v_proj.bias": "attn_v",
          "self_attn.q_norm.weight": "attn_q_norm", "self_attn.k_norm.weight": "attn_k_norm"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def gguf_name(key: str) -> str:
    """The GGUF name of a transformers state-dict key (``model.layers.2.mlp.up_proj.weight`` ->
    ``blk.2.ffn_up.weight``)."""
    if key in _GLOBAL:
        return _GLOBAL[key]
    _, _, index, rest = key.split(".", 3)
    return f"blk.{index}.{_LAYER[rest]}.{rest.rsplit('.', 1)[1]}"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute: q/k rows reordered for llama.cpp's interleaved RoPE."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(cfg) -> np.ndarray:
    """The ``rope_freqs`` divisors convert_hf_to_gguf computes for a ``llama3`` RoPE scaling."""
    s = _rope_scaling(cfg)
    dim = _head_dim(cfg)
    base = float(_rope_theta(cfg))
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old = float(s["original_max_position_embeddings"])
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def write_gguf(model, path: Path, matrices: str = "F32") -> Path:
    """Write ``model`` (a transformers causal LM of the Llama family or Qwen3) to ``path`` as GGUF."""
    import gguf

    if matrices not in MATRIX_TYPES:
        raise ValueError(f"matrices must be one of {MATRIX_TYPES}, got {matrices!r}")
    cfg = model.config
    arch = cfg.model_type
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(_rope_theta(cfg)))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if getattr(cfg, "head_dim", None):
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.bos_token_id is not None:
        w.add_bos_token_id(cfg.bos_token_id)
    if cfg.eos_token_id is not None:
        w.add_eos_token_id(cfg.eos_token_id)
    scaling = _rope_scaling(cfg)
    if scaling and scaling.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg))
    for key, value in _stored_state(model).items():
        name = gguf_name(key)
        arr = value.detach().float().numpy()
        if arch == "llama" and name.startswith("blk.") and (".attn_q." in name or ".attn_k." in name):
            arr = _permute(arr, cfg.num_attention_heads if ".attn_q." in name else cfg.num_key_value_heads)
        _add(w, name, np.ascontiguousarray(arr), matrices)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def as_stored(model, matrices: str):
    """A copy of ``model`` holding the values a ``matrices`` GGUF of it stores (quantised and widened back)."""
    import gguf

    if matrices == "F32":
        return model
    ref = copy.deepcopy(model)
    qtype = gguf.GGMLQuantizationType[matrices]
    with torch.no_grad():
        for p in ref.parameters():  # a tied head is the embedding's parameter: rounded once
            if p.dim() == 2:
                arr = p.detach().float().numpy()
                back = gguf.quants.dequantize(gguf.quants.quantize(arr, qtype), qtype).reshape(arr.shape)
                p.copy_(torch.from_numpy(np.asarray(back, dtype=np.float32)))
    return ref.eval()


def _stored_state(model) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    if model.config.tie_word_embeddings:  # the converter writes no output.weight for a tied head
        state.pop("lm_head.weight", None)
    return state


def _add(w, name: str, arr: np.ndarray, matrices: str) -> None:
    import gguf

    if arr.ndim != 2 or matrices == "F32":
        w.add_tensor(name, arr.astype(np.float32))
    elif matrices == "F16":
        w.add_tensor(name, arr.astype(np.float16))
    else:
        qtype = gguf.GGMLQuantizationType[matrices]
        w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _rope_params(cfg) -> dict:
    return dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})


def _rope_theta(cfg) -> float:
    return getattr(cfg, "rope_theta", None) or _rope_params(cfg).get("rope_theta", 10000.0)


def _rope_scaling(cfg) -> dict | None:
    params = _rope_params(cfg)
    return params if params.get("rope_type") not in (None, "default") else None
