"""Incremental detokenisation for streaming.

Byte-level BPE splits multi-byte characters across tokens; decoding each token
alone would emit broken characters. We decode the growing id list and emit
only the stable new suffix, holding back while it ends in a replacement char.
"""

from __future__ import annotations


class IncrementalDecoder:
    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        delta = text[len(self.emitted):] if text.startswith(self.emitted) else ""
        self.emitted = text
        return delta

    @property
    def text(self) -> str:
        return self.tok.decode(self.ids)
