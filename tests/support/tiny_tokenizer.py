"""Tiny byte-level tokenizers with a model family's added tokens, built in-process (no download).

A byte-level BPE with the 256 byte pieces and no merges encodes any text, so a
chat template's output tokenises as it would with the real vocabulary where it
matters: the family's control tokens (``<|im_start|>``, ``<|eot_id|>``…) and
its tags (``<think>``, ``<tool_call>``) are single added tokens, special or not
as the published ``tokenizer.json`` marks them. The same file feeds meshd's
:class:`~decoding.loader.tokenizer.Tokenizer` and transformers' reference.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

# (text, special) as each family's tokenizer.json lists them.
QWEN3 = (("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
         ("<tool_call>", False), ("</tool_call>", False), ("<tool_response>", False),
         ("</tool_response>", False), ("<think>", False), ("</think>", False))
LLAMA3 = (("<|begin_of_text|>", True), ("<|end_of_text|>", True), ("<|start_header_id|>", True),
          ("<|end_header_id|>", True), ("<|eom_id|>", True), ("<|eot_id|>", True), ("<|python_tag|>", True))


def byte_pieces() -> list[str]:
    """The 256 byte tokens in id order, as GPT-2 spells them."""
    return sorted(_byte_map(), key=_byte_map().get)


def _byte_map() -> dict[str, int]:
    """GPT-2's printable stand-in for each byte, in byte order (ids 0-255)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return {chars[b]: b for b in range(256)}


def write_tokenizer(path: Path, added: tuple[tuple[str, bool], ...]) -> Path:
    """A ``tokenizer.json`` at ``path``: 256 byte tokens, then ``added`` (ids 256…)."""
    tok = Tokenizer(models.BPE(vocab=_byte_map(), merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    for text, special in added:
        token = AddedToken(text, special=special, normalized=False)
        if special:
            tok.add_special_tokens([token])
        else:
            tok.add_tokens([token])
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def token_id(path: Path, text: str) -> int:
    return Tokenizer.from_file(str(path)).token_to_id(text)
