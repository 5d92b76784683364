"""Tokenizer + chat template, loaded in milliseconds from a cached ``tokenizer.json``.

Converting a GGUF vocabulary with transformers takes seconds, so it is done once
per model file and the result (tokenizer.json + a small meta file holding the
chat template and special ids) is cached next to the model cache. Daemons that
restart, and every CLI call, then load with the `tokenizers` library directly.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from decoding.errors import ModelLoadError
from decoding.loader.chat_template import ChatTemplate


@dataclass
class TokenizerMeta:
    chat_template: str | None
    bos_id: int | None
    eos_ids: tuple[int, ...]
    add_bos: bool
    bos_token: str | None = None
    eos_token: str | None = None


def vocabulary_fingerprint(tokenizer) -> str:
    """A digest of the vocabulary (id -> piece) and the special ids: equal iff the token ids mean the
    same (a draft model and its target, a device and its cloud verifier)."""
    h = hashlib.sha256()
    n = tokenizer.vocab_size
    h.update(str(n).encode())
    pieces = tokenizer.pieces() if hasattr(tokenizer, "pieces") else None
    if pieces is not None:
        for piece, idx in sorted(pieces.items(), key=lambda kv: kv[1]):
            h.update(f"{idx}\x00{piece}\x01".encode())
    else:  # a tokenizer without a piece table: decode every id
        for i in range(n):
            h.update(tokenizer.decode([i], skip_special=False).encode("utf-8", "surrogatepass"))
    h.update(repr(tuple(tokenizer.eos_ids)).encode())
    return h.hexdigest()


FINGERPRINT_FILE = "fingerprint.json"
FINGERPRINT_VERSION = 1  # raise with any change to vocabulary_fingerprint: kept ones are then computed again


class Tokenizer:
    def __init__(self, tokenizer_json: Path, meta: TokenizerMeta, cache_dir: Path | None = None):
        self._cache_dir = cache_dir  # ours to write in (a model's own folder is not)
        try:
            raw = Path(tokenizer_json).read_bytes()
            self._tok = _HFTokenizer.from_str(raw.decode("utf-8"))
        except OSError as exc:
            raise ModelLoadError(f"{tokenizer_json}: cannot read it ({exc})") from exc
        except Exception as exc:  # tokenizers raises plain Exception subclasses; a bad encoding too
            raise ModelLoadError(f"{tokenizer_json}: not a valid tokenizer.json ({exc})") from exc
        # what a kept fingerprint must have been computed from: these bytes, these end ids, this digest's version
        self._fingerprint_of = hashlib.sha256(
            f"{FINGERPRINT_VERSION}:".encode() + raw + repr(tuple(meta.eos_ids)).encode()).hexdigest()
        self.path = Path(tokenizer_json)  # grammar libraries load the vocabulary from it
        self.meta = replace(meta, chat_template=repair_template(meta.chat_template))

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self.meta.eos_ids

    @property
    def backend(self):
        """The ``tokenizers`` object itself, for libraries that take one (transformers, llguidance)."""
        return self._tok

    @cached_property
    def fingerprint(self) -> str:
        """:func:`vocabulary_fingerprint`, kept in the tokenizer's cache folder: computing it walks a
        150k vocabulary in Python (~0.7 s holding the GIL), which a restarting device would otherwise
        pay before it is ready. The kept one counts only for the same tokenizer.json bytes."""
        of = self._fingerprint_of
        kept = self._cache_dir / FINGERPRINT_FILE if self._cache_dir is not None else None
        if kept is not None:
            try:
                data = json.loads(kept.read_text())
                if data["of"] == of and isinstance(data["fingerprint"], str):
                    return data["fingerprint"]
            except (OSError, ValueError, KeyError, TypeError):
                pass
        fp = vocabulary_fingerprint(self)
        if kept is not None:
            try:
                tmp = kept.with_name(f"{kept.name}.{os.getpid()}.partial")
                tmp.write_text(json.dumps({"of": of, "fingerprint": fp}))
                tmp.replace(kept)
            except OSError:
                pass  # a read-only cache: computed again next start
        return fp

    def pieces(self) -> dict[str, int]:
        """Every piece of the vocabulary and its id (added tokens included)."""
        return self._tok.get_vocab(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if (self.meta.add_bos if add_bos is None else add_bos) and self.meta.bos_id is not None:
            ids = [self.meta.bos_id] + ids
        return ids

    def decode(self, ids, skip_special: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    @cached_property
    def _template(self) -> ChatTemplate | None:
        return ChatTemplate(self.meta.chat_template) if self.meta.chat_template else None

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders a ``tools`` list (so the model was trained on calls)."""
        return bool(self.meta.chat_template) and "tools" in self.meta.chat_template

    @property
    def supports_thinking(self) -> bool:
        """Whether the chat template teaches ``<think>`` blocks (Qwen3): answers may start with reasoning."""
        return bool(self.meta.chat_template) and "</think>" in self.meta.chat_template

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, **variables) -> str:
        """The prompt text, as transformers' ``apply_chat_template`` renders it (``decoding.loader.chat_template``).

        ``variables`` are the template's own switches, e.g. Qwen3's ``enable_thinking``.
        """
        if self._template is None:
            # A base model without a template: plain concatenation is the honest fallback.
            return "\n".join(m["content"] for m in messages) + "\n"
        return self._template.render(
            messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
            special_tokens={"bos_token": self.meta.bos_token or "", "eos_token": self.meta.eos_token or ""},
            **variables)

    def apply_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                   tools: list[dict] | None = None, **variables) -> list[int]:
        """Token ids of a chat prompt; the template already places special tokens."""
        text = self.render_chat(messages, add_generation_prompt, tools, **variables)
        has_bos_in_text = self.meta.bos_token and text.startswith(self.meta.bos_token)
        return self.encode(text, add_bos=self.meta.add_bos and not has_bos_in_text)


# Known defects of chat templates as some GGUF files carry them, and the authors' text. The
# Qwen2.5-Coder-1.5B-Instruct GGUF shows its call format with doubled braces (a str.format
# escape that was never undone), and the model copies them: every call it writes is then
# `{{"name": ...}}`. The model's own template (transformers' tokenizer_config.json) has one.
_TEMPLATE_REPAIRS = (
    ('{{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}}',
     '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}'),
)


def repair_template(template: str | None) -> str | None:
    """``template`` with the known defects above replaced by what the model's authors wrote."""
    for bad, good in _TEMPLATE_REPAIRS:
        if template and bad in template:
            template = template.replace(bad, good)
    return template


def save_cache(cache_dir: Path, hf_tokenizer, meta: TokenizerMeta) -> None:
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / "tokenizer.json.partial"
    hf_tokenizer.save(str(tmp))
    tmp.replace(cache_dir / "tokenizer.json")
    (cache_dir / "tokenizer_meta.json").write_text(json.dumps(meta.__dict__ | {"eos_ids": list(meta.eos_ids)}))


def load_cache(cache_dir: Path) -> Tokenizer | None:
    tj, mj = cache_dir / "tokenizer.json", cache_dir / "tokenizer_meta.json"
    if not (tj.is_file() and mj.is_file()):
        return None
    raw = json.loads(mj.read_text())
    raw["eos_ids"] = tuple(raw["eos_ids"])
    return Tokenizer(tj, TokenizerMeta(**raw), cache_dir)
