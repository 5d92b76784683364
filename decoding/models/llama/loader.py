"""Building a Llama-family stage from a model source: which tensors, fused how, held in what form."""

from __future__ import annotations

import torch

from decoding.device import CPU
from decoding.errors import ModelLoadError
from decoding.linear import PackedLinear
from decoding.models.llama.layers import LayerWeights
from decoding.models.llama.rope import inv_frequencies


def load_stage(cls, source, first: int, end: int, dtype: torch.dtype = torch.float32,
               device: torch.device | str | None = None, packed: str | bool = ""):
    """Load ``[first, end)`` from ``source`` in ``dtype`` onto ``device`` (default: the CPU) as a ``cls``.

    Tensors are read (dequantised) on the host a few at a time and each is cast
    and moved in one step, so loading onto a GPU never holds a host copy of
    the whole stage. ``packed`` (a packed numeric mode, "packed" or "packed4",
    bfloat16 on the CPU): every matrix is held as 4- or 8-bit groups instead
    (see :func:`load_packed`) and the token embedding as the file stores it.
    """
    cfg = source.config
    if not 0 <= first < end <= cfg.num_layers:
        raise ModelLoadError(
            f"{source.path}: invalid layer range [{first}, {end}) for a {cfg.num_layers}-layer model")
    device = CPU if device is None else torch.device(device)
    packing = "packed" if packed is True else (packed or "")
    if packing == "gguf":
        return load_blocks(cls, source, first, end, device)
    if packing:
        return load_packed(cls, source, first, end, dtype, device, packing)
    cast = lambda t: t.to(device=device, dtype=dtype).contiguous()  # noqa: E731
    layers = []
    for i in range(first, end):
        r = lambda n: source.read_tensor(f"layers.{i}.{n}")  # noqa: E731
        bias = None
        if cfg.attention_bias:
            bias = cast(torch.cat([r("q_bias"), r("k_bias"), r("v_bias")]))
        layers.append(LayerWeights(
            attn_norm=cast(r("attn_norm")), qkv=cast(torch.cat([r("q"), r("k"), r("v")])),
            qkv_bias=bias, o=cast(r("o")), mlp_norm=cast(r("mlp_norm")),
            gate_up=cast(torch.cat([r("gate"), r("up")])), down=cast(r("down")),
        ))
    embed = final_norm = lm_head = None
    is_last = end == cfg.num_layers
    if first == 0 or (is_last and cfg.tie_embeddings):
        embed_full = cast(source.read_tensor("embed"))
        embed = embed_full if first == 0 else None
        if is_last and cfg.tie_embeddings:
            lm_head = embed_full
    if is_last:
        final_norm = cast(source.read_tensor("final_norm"))
        if lm_head is None:
            lm_head = cast(source.read_tensor("lm_head"))
    inv_freq, _ = inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                  source.rope_freq_factors())
    return cls(cfg, first, end, layers, embed, final_norm, lm_head, inv_freq.to(device), dtype)


def load_packed(cls, source, first: int, end: int, dtype: torch.dtype, device: torch.device, packing: str):
    """``[first, end)`` with every matrix packed (``decoding.quant``), sharing one scratch buffer.

    What each tensor becomes (``formats`` records it, per tensor):

    ========================  ============================  ===========================
    stored in the file as     ``packed``                    ``packed4``
    ========================  ============================  ===========================
    Q4_0, Q4_1, Q4_K          4-bit, its own codes          4-bit, its own codes
    Q8_0, Q5_0                8-bit (two planes), own codes 4-bit, rounded
    Q6_K, F16, F32, others    8-bit, rounded (finer than    4-bit, rounded
                              the file's own steps)
    ========================  ============================  ===========================

    Only scales and offsets change format (bfloat16) where codes are kept. The
    token embedding stays as the file stores it and is widened per lookup.
    """
    from decoding.quant.groups import Int4Groups, requantize, requantize_8bit
    from decoding.quant.packed import ConcatLinear, Scratch
    from decoding.quant.rows import QuantRows

    if device.type != "cpu":
        raise ModelLoadError(f"the packed numeric modes run on the CPU; {device} takes bfloat16 or float16")
    if packing not in ("packed", "packed4"):
        raise ValueError(f"unknown packing {packing!r} (packed, packed4)")
    cfg = source.config
    scratch = Scratch()
    formats: dict[str, str] = {}
    cast = lambda t: t.to(dtype=dtype).contiguous()  # noqa: E731
    kind_of = getattr(source, "tensor_type", lambda n: None)
    four_bit_of = getattr(source, "read_int4_groups", lambda n: None)
    eight_bit_of = getattr(source, "read_int8_planes", lambda n: None)

    def planes(name: str, key: str) -> list[Int4Groups]:
        kind = kind_of(name) or "float"
        exact = four_bit_of(name)
        if exact is not None:
            formats[key] = f"int4 ({kind}, its own codes)"
            return [exact]
        if packing == "packed4":
            formats[key] = f"int4 (rounded from {kind})"
            return [requantize(source.read_tensor(name))]
        kept = eight_bit_of(name)
        if kept is not None:
            formats[key] = f"int8 ({kind}, its own codes)"
            return list(kept)
        formats[key] = f"int8 (rounded from {kind})"
        return list(requantize_8bit(source.read_tensor(name)))

    def packed(*names: str, key: str = ""):
        parts = [planes(n, key or n) for n in names]
        if len({len(p) for p in parts}) == 1:  # same width: one matrix, one product
            return PackedLinear([Int4Groups.concat([p[i] for p in parts]) for i in range(len(parts[0]))], scratch)
        return ConcatLinear([PackedLinear(p, scratch) for p in parts])

    layers = []
    for i in range(first, end):
        p = f"layers.{i}."
        r = lambda n: source.read_tensor(p + n)  # noqa: E731
        bias = cast(torch.cat([r("q_bias"), r("k_bias"), r("v_bias")])) if cfg.attention_bias else None
        layers.append(LayerWeights(
            attn_norm=cast(r("attn_norm")), qkv=packed(p + "q", p + "k", p + "v"), qkv_bias=bias,
            o=packed(p + "o"), mlp_norm=cast(r("mlp_norm")), gate_up=packed(p + "gate", p + "up"),
            down=packed(p + "down")))
    embed = final_norm = lm_head = None
    if end == cfg.num_layers:
        final_norm = cast(source.read_tensor("final_norm"))
        lm_head = packed("embed" if cfg.tie_embeddings else "lm_head", key="lm_head")
    if first == 0 and cfg.tie_embeddings:
        # One matrix, as in the file, and the same values wherever it is held: a first stage that is
        # not the last looks rows up in the packed matrix the last stage multiplies by, so a mesh
        # embeds exactly as one device does.
        embed = lm_head if lm_head is not None else packed("embed", key="lm_head")
        formats["embed"] = "the LM head's rows, widened per lookup"
    elif first == 0:
        if hasattr(source, "read_row_blocks"):
            embed = QuantRows(*source.read_row_blocks("embed"), dtype)
            formats["embed"] = f"{embed.type_name} rows, widened per lookup"
        else:
            embed = cast(source.read_tensor("embed"))
    inv_freq, _ = inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, source.rope_freq_factors())
    stage = cls(cfg, first, end, layers, embed, final_norm, lm_head, inv_freq, dtype)
    stage.formats, stage.scratch, stage.packing = formats, scratch, packing
    return stage


def load_blocks(cls, source, first: int, end: int, device: torch.device):
    """``[first, end)`` in the ``gguf`` mode: every matrix the integer kernels multiply stays a view of the
    mapped file (``decoding.quant.blocks``). Nothing is widened or copied, so loading costs the page reads.

    A matrix of a type they do not take (F16, BF16, F32, Q2_K, Q3_K, the IQ types; a source that is not
    a GGUF) is rounded to Q8_0 once, in memory: every product still goes through the kernels, so every
    row stays computed alike whatever is batched with it (a float product would not), and ``formats``
    names the rounding. Norms and biases are read as float32.
    """
    import gguf
    import numpy as np

    from decoding.quant.blocks import BlockLinear, BlockPart

    if device.type != "cpu":
        raise ModelLoadError(f"the gguf numeric mode runs on the CPU; {device} takes bfloat16 or float16")
    cfg = source.config
    formats: dict[str, str] = {}
    blocks_of = getattr(source, "read_blocks", lambda n: None)
    kind_of = getattr(source, "tensor_type", lambda n: None)

    def part(name: str) -> tuple[BlockPart, str]:
        found = blocks_of(name)
        if found is not None:
            return found, f"{found.type_name} blocks, mapped"
        w = source.read_tensor(name).float().numpy()  # rows as the model orders them
        if w.shape[1] % 32:
            raise ModelLoadError(f"{name}: {w.shape[1]} columns are not whole Q8_0 blocks for the gguf mode")
        raw = np.asarray(gguf.quants.quantize(np.ascontiguousarray(w), gguf.GGMLQuantizationType.Q8_0))
        return BlockPart("Q8_0", raw.reshape(w.shape[0], -1), w.shape[1]), f"Q8_0, rounded from {kind_of(name) or 'float'}"

    def weight(*names: str, key: str = ""):
        made = [part(n) for n in names]
        formats[key or names[0]] = "+".join(dict.fromkeys(how for _, how in made))
        return BlockLinear([p for p, _ in made])

    layers = []
    for i in range(first, end):
        p = f"layers.{i}."
        r = lambda n: source.read_tensor(p + n)  # noqa: E731
        bias = torch.cat([r("q_bias"), r("k_bias"), r("v_bias")]) if cfg.attention_bias else None
        layers.append(LayerWeights(
            attn_norm=r("attn_norm"), qkv=weight(p + "q", p + "k", p + "v"), qkv_bias=bias,
            o=weight(p + "o"), mlp_norm=r("mlp_norm"), gate_up=weight(p + "gate", p + "up"),
            down=weight(p + "down")))
    embed = final_norm = lm_head = None
    if end == cfg.num_layers:
        final_norm = source.read_tensor("final_norm")
        lm_head = weight("embed" if cfg.tie_embeddings else "lm_head", key="lm_head")
    if first == 0:
        if cfg.tie_embeddings and lm_head is not None:
            embed = lm_head  # one matrix, as in the file: rows widened per lookup
            formats["embed"] = formats["lm_head"] + ", rows widened per lookup"
        elif blocks_of("embed") is None and hasattr(source, "read_row_blocks"):
            from decoding.quant.rows import QuantRows  # only looked up: any type, as stored

            embed = QuantRows(*source.read_row_blocks("embed"), torch.float32)
            formats["embed"] = f"{embed.type_name} rows, widened per lookup"
        else:
            embed = weight("embed")
            formats["embed"] += ", rows widened per lookup"
    inv_freq, _ = inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, source.rope_freq_factors())
    stage = cls(cfg, first, end, layers, embed, final_norm, lm_head, inv_freq, torch.float32)
    stage.formats, stage.packing = formats, "gguf"
    return stage
