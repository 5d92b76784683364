"""Incremental detokenisation for streaming.

Byte-level BPE splits multi-byte characters across tokens, and some
tokenizers' spacing depends on the neighbouring token, so decoding each token
alone is wrong. We re-decode a short window and emit only the text that
became stable (the prefix/read-offset scheme vLLM and TGI use): O(1) work per
token, however long the answer.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decoding ids one at a time is wrong for byte-level BPE (a character can
    span tokens) and for tokenizers whose spacing depends on the neighbour, so
    we re-decode a short window and emit only what became stable — the same
    prefix/read offset scheme as vLLM and TGI.
    """

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # ids already turned into emitted text

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read])
        text = self._tok.decode(self._ids[self._prefix :])
        if len(text) > len(prefix_text) and not text.endswith("\ufffd"):
            delta = text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self._ids)
            return delta
        return ""

    def flush(self) -> str:
        """Text of ids still held back (e.g. an incomplete character at the end)."""
        if self._read == len(self._ids):
            return ""
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read])
        text = self._tok.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return text[len(prefix_text) :].rstrip("\ufffd")
