"""Prompts an operator pins in the stages' prefix caches (``pin_prompts``), as token ids.

A home's assistant starts every request with the same system prompt; pinning
it keeps its KV in every stage however many other conversations come and go.
A pin file holds either the text itself (tokenized as it is) or a JSON chat
request, ``{"messages": [...], "tools": [...]}``, rendered with the model's
chat template without a generation prompt — the same rendering a request with
those messages starts with, so its token ids are a prefix of every such request.
"""

from __future__ import annotations

import json
from pathlib import Path

from meshd.config import ConfigError
from meshd.log import get_logger

log = get_logger("meshd.pins")

__all__ = ["pinned_prefixes", "MAX_PIN_BYTES"]

MAX_PIN_BYTES = 1 << 20


def pinned_prefixes(paths: list[str], tokenizer) -> list[list[int]]:
    """The token ids of every pin file (a clear ``ConfigError`` for one that cannot be read)."""
    out = []
    for name in paths:
        path = Path(name).expanduser()
        try:
            if path.stat().st_size > MAX_PIN_BYTES:
                raise ConfigError(f"pin_prompts: {path} is over {MAX_PIN_BYTES} bytes")
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"pin_prompts: cannot read {path}: {exc.strerror or exc}") from None
        ids = _ids_of(text, tokenizer, path)
        if ids:
            out.append(ids)
            log.info("prompt_pinned", path=str(path), tokens=len(ids))
    return out


def _ids_of(text: str, tokenizer, path: Path) -> list[int]:
    stripped = text.lstrip()
    if stripped.startswith("{"):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"pin_prompts: {path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
        messages = doc.get("messages") if isinstance(doc, dict) else None
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("content", ""), str) for m in messages):
            raise ConfigError(f"pin_prompts: {path} needs a non-empty \"messages\" list of chat messages")
        tools = doc.get("tools") or None
        return list(tokenizer.apply_chat(messages, add_generation_prompt=False, tools=tools))
    return list(tokenizer.encode(text, add_bos=False))
