"""A tiny random-weight Llama GGUF for the model-sharing tests (no tokenizer: stages only).

Small enough that a manifest, a partial copy and a stage load take milliseconds,
shaped like a real file: a header, per-block tensors, an embedding, a head
(untied, or tied to the embedding), alignment gaps between tensors.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 44, 96, 2, 1, 128  # 44 floats: norms leave alignment gaps


def write_tiny_gguf(path: Path, layers: int = 5, tied: bool = False, rope_freqs: bool = False,
                    seed: int = 0) -> Path:
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_context_length(256)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(VOCAB)
    kv = HIDDEN // HEADS * KV_HEADS
    t = lambda *shape: (rng.standard_normal(shape) * 0.1).astype(np.float32)  # noqa: E731
    w.add_tensor("token_embd.weight", t(VOCAB, HIDDEN))
    if rope_freqs:
        w.add_tensor("rope_freqs.weight", 1 + np.abs(t(HIDDEN // HEADS // 2)))
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", 1 + t(HIDDEN))
        w.add_tensor(p + "attn_q.weight", t(HIDDEN, HIDDEN))
        w.add_tensor(p + "attn_k.weight", t(kv, HIDDEN))
        w.add_tensor(p + "attn_v.weight", t(kv, HIDDEN))
        w.add_tensor(p + "attn_output.weight", t(HIDDEN, HIDDEN))
        w.add_tensor(p + "ffn_norm.weight", 1 + t(HIDDEN))
        w.add_tensor(p + "ffn_gate.weight", t(FFN, HIDDEN))
        w.add_tensor(p + "ffn_up.weight", t(FFN, HIDDEN))
        w.add_tensor(p + "ffn_down.weight", t(HIDDEN, FFN))
    w.add_tensor("output_norm.weight", 1 + t(HIDDEN))
    if not tied:
        w.add_tensor("output.weight", t(VOCAB, HIDDEN))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
