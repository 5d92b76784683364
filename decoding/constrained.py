"""Structured output: a per-request token mask that only lets valid continuations through.

A request that asks for JSON (OpenAI ``response_format``, Ollama ``format``)
or a grammar gets a :class:`TokenConstraint`. Before each sampled token the
sampler asks :meth:`TokenConstraint.allowed_mask` and sets every disallowed
logit to ``-inf``; after it, :meth:`TokenConstraint.advance` moves the
grammar. The answer then parses and validates by construction (unless it is
cut short by ``max_tokens``).

The grammar engine is llguidance (chosen over xgrammar by measurement, see
``bench/constrained.py`` and bench/RESULTS.md: both cost well under 0.1 ms a
token, llguidance compiles a request's schema 4-30x faster, which is on every
request's time to first token, and it is one small wheel). This module is the
only place that knows it: the rest of the code deals in spec dicts and bool
masks.

Specs (plain JSON-able dicts, so they cross process and wire boundaries):

* ``{"type": "json_object"}``: any JSON object.
* ``{"type": "json_schema", "schema": {...}}``: JSON valid against the schema.
* ``{"type": "lark", "grammar": "..."}``: a Lark grammar (llguidance's dialect).
* ``{"type": "regex", "pattern": "..."}``: text matching the regex.
* ``{"type": "tool_calls", ...}``: free text or calls of the offered tools, with
  the grammar switched on lazily (:mod:`decoding.tool_grammar`).

:func:`make_constraint` builds the right object for a spec (a tool-call spec's is
:class:`decoding.tool_constraint.ToolCallConstraint`); both kinds answer the same
five questions (mask, advance, finished, accepting, rollback), and the two a drafter
asks under a grammar (:meth:`TokenConstraint.forced_draft`, :meth:`TokenConstraint.valid_prefix`).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import torch

from decoding.errors import DecodingError

SPEC_TYPES = ("json_object", "json_schema", "lark", "regex", "tool_calls")
MAX_SPEC_BYTES = 256 * 1024  # a schema larger than this is not a request, it is an attack
# Models are trained on json.dumps-style JSON; fixed separators also mean the
# model cannot wander off into endless whitespace inside a JSON answer.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class BadConstraint(DecodingError):
    """A structured-output spec cannot be compiled (bad schema or grammar): a 400 for the client."""


class ConstraintViolated(DecodingError):
    """A token the constraint does not allow was fed to :meth:`TokenConstraint.advance` (a bug)."""


def validate_spec(spec: Any) -> dict[str, Any]:
    """Check ``spec`` and compile its grammar without a tokenizer; returns the spec.

    Cheap enough for the API to call on every request, so a bad schema is a
    400 before any model work starts.
    """
    grammar = _grammar(spec)
    import llguidance

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise BadConstraint(f"{_what(spec)} cannot be used: {_short(messages[0] if messages else '')}")
    return spec


def _what(spec: dict) -> str:
    return {"json_schema": "the JSON schema", "json_object": "the JSON object format",
            "lark": "the grammar", "regex": "the regular expression",
            "tool_calls": "the tools' parameter schemas"}.get(spec.get("type"), "the spec")


def _short(msg: str) -> str:
    return " ".join(str(msg).split())[:300]


def _grammar(spec: Any) -> str:
    """The llguidance grammar (a string) for ``spec``; raises BadConstraint."""
    import llguidance

    if not isinstance(spec, dict) or spec.get("type") not in SPEC_TYPES:
        raise BadConstraint(f"a constraint must be an object with type one of {list(SPEC_TYPES)}")
    kind = spec["type"]
    try:
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                                 overrides=_JSON_OPTIONS)
        if kind == "json_schema":
            schema = spec.get("schema")
            if not isinstance(schema, dict):
                raise BadConstraint("a json_schema constraint needs 'schema', a JSON object")
            if len(json.dumps(schema)) > MAX_SPEC_BYTES:
                raise BadConstraint(f"the JSON schema is over {MAX_SPEC_BYTES} bytes")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
        if kind == "tool_calls":
            from decoding.tool_grammar import BadToolSpec, build

            if len(json.dumps(spec)) > MAX_SPEC_BYTES:
                raise BadConstraint(f"the tools are over {MAX_SPEC_BYTES} bytes")
            try:
                return llguidance.LLMatcher.grammar_from_lark(build(spec).calls)
            except BadToolSpec as exc:
                raise BadConstraint(str(exc)) from None
        if kind == "lark":
            text = spec.get("grammar")
            if not isinstance(text, str) or not text or len(text) > MAX_SPEC_BYTES:
                raise BadConstraint("a lark constraint needs 'grammar', a non-empty string")
            return llguidance.LLMatcher.grammar_from_lark(text)
        pattern = spec.get("pattern")
        if not isinstance(pattern, str) or not pattern or len(pattern) > MAX_SPEC_BYTES:
            raise BadConstraint("a regex constraint needs 'pattern', a non-empty string")
        return llguidance.LLMatcher.grammar_from_regex(pattern)
    except BadConstraint:
        raise
    except (ValueError, TypeError, RuntimeError) as exc:
        raise BadConstraint(f"{_what(spec)} cannot be used: {_short(exc)}") from None


# --------------------------------------------------------------------------- tokenizers

_TOKENIZERS: dict[tuple[str, int, tuple[int, ...]], Any] = {}
_TOKENIZERS_LOCK = threading.Lock()


def grammar_tokenizer(tokenizer_json: str | Path, vocab_size: int, eos_ids: tuple[int, ...]):
    """llguidance's view of a model's vocabulary, built once per model (0.2-1 s) and cached.

    ``vocab_size`` is the model's logit width, which may exceed the tokenizer's
    own vocabulary (padding rows): masks are always that wide.
    """
    import llguidance

    key = (str(tokenizer_json), int(vocab_size), tuple(eos_ids))
    with _TOKENIZERS_LOCK:
        tok = _TOKENIZERS.get(key)
        if tok is None:
            tok = llguidance.LLTokenizer(str(tokenizer_json), n_vocab=int(vocab_size),
                                         eos_token=list(eos_ids) or None)
            _TOKENIZERS[key] = tok
        return tok


def warm(tokenizer_json: str | Path, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
    """Pay the grammar engine's one-off set-up for this vocabulary now (2-4 s for a 150k
    vocabulary), not in the first structured or tool-calling request's time to first token."""
    TokenConstraint({"type": "json_object"}, tokenizer_json, vocab_size, eos_ids).allowed_mask()


# --------------------------------------------------------------------------- constraint


class TokenConstraint:
    """One request's grammar state: which next tokens are allowed, advanced token by token.

    Not thread-safe; one generation owns it. ``eos_ids`` are allowed exactly
    when the text so far is complete (e.g. the JSON object is closed).
    """

    def __init__(self, spec: dict[str, Any], tokenizer_json: str | Path, vocab_size: int,
                 eos_ids: tuple[int, ...]):
        import llguidance

        self.spec = spec
        self.vocab_size = int(vocab_size)
        self._tok = grammar_tokenizer(tokenizer_json, vocab_size, eos_ids)
        self._matcher = llguidance.LLMatcher(self._tok, _grammar(spec), log_level=0)
        if self._matcher.is_error():
            raise BadConstraint(f"{_what(spec)} cannot be used: {_short(self._matcher.get_error())}")
        self._bits = None
        self._consumed = 0

    def allowed_mask(self, vocab_size: int | None = None) -> torch.Tensor:
        """Bool tensor ``[vocab_size]``: True where the token may come next."""
        # llguidance's numpy helpers, not its torch ones: importing those compiles a kernel with
        # torch.compile, which imports torch's dynamo (~2 s of a device's start, holding the GIL)
        import llguidance.numpy as ln

        n = int(vocab_size or self.vocab_size)
        if n != self.vocab_size:
            raise ValueError(f"mask asked for {n} tokens; the constraint was built for {self.vocab_size}")
        if self._bits is None:
            self._bits = ln.allocate_token_bitmask(1, n)
        ln.fill_next_token_bitmask(self._matcher, self._bits, 0)
        if self._matcher.is_error():
            raise ConstraintViolated(self._matcher.get_error())
        return unpack_bitmask(torch.from_numpy(self._bits[0]), n)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` with every disallowed token at ``-inf`` (a new tensor)."""
        mask = self.allowed_mask(logits.shape[-1])
        return logits.masked_fill(~mask, float("-inf"))

    def advance(self, token_id: int) -> None:
        """Move past ``token_id``; raises :class:`ConstraintViolated` if it was not allowed."""
        if not self._matcher.consume_token(int(token_id)):
            raise ConstraintViolated(f"token {token_id} is not allowed here: {self._matcher.get_error()}")
        self._consumed += 1

    def is_finished(self) -> bool:
        """True when nothing more may be generated (the grammar is complete and closed)."""
        return self._matcher.is_stopped()

    def is_accepting(self) -> bool:
        """True when the text so far is complete (end-of-sequence is allowed now)."""
        return self._matcher.is_accepting()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` advances (rejected speculative tokens)."""
        if not 0 <= num_tokens <= self._consumed:
            raise ValueError(f"cannot roll back {num_tokens} tokens; {self._consumed} were consumed")
        if num_tokens and not self._matcher.rollback(int(num_tokens)):
            raise ConstraintViolated(f"rollback failed: {self._matcher.get_error()}")
        self._consumed -= num_tokens

    def restart(self) -> None:
        """Back to the state before the first token (a replayed request feeds its tokens again)."""
        self._matcher.reset()
        self._consumed = 0

    def forced_draft(self, limit: int = 16) -> list[int]:
        """The tokens the grammar forces next (up to ``limit``), as a *draft*.

        llguidance's forced tokens: the canonical tokenization of the forced text, stopped before
        a token the text after it could still merge into (``name`` of ``name"``, not the ``"``,
        which the model may write as ``":``). So nearly all are taken; a verify round still checks
        each against the masked model, so none is taken merely because the grammar had one choice.
        """
        if limit <= 0:
            return []
        tokens = [int(t) for t in self._matcher.compute_ff_tokens()[:limit]]
        return tokens[:self.valid_prefix(tokens)]

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens`` the grammar takes from here, in order (the state does not move)."""
        return int(self._matcher.validate_tokens([int(t) for t in tokens])) if tokens else 0


def unpack_bitmask(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """llguidance's packed int32 words (bit i of word w = token 32*w + i) -> bool ``[vocab_size]``."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    unpacked = (bits.to(torch.int32).unsqueeze(-1) >> shifts) & 1
    return unpacked.reshape(-1)[:vocab_size].to(torch.bool)


def constraint_for(spec: dict[str, Any], tokenizer, vocab_size: int):
    """:func:`make_constraint` for a model's tokenizer (its ``tokenizer.json`` ``path`` and ``eos_ids``):
    the last stage's selector and the coordinator's drafting copy are built alike."""
    return make_constraint(spec, tokenizer.path, vocab_size, tuple(tokenizer.eos_ids))


def make_constraint(spec: dict[str, Any], tokenizer_json: str | Path, vocab_size: int,
                    eos_ids: tuple[int, ...]):
    """The constraint object for ``spec``: a :class:`~decoding.tool_constraint.ToolCallConstraint` for
    ``tool_calls`` (loaded only then, with the tool grammar it needs), else a :class:`TokenConstraint`."""
    if isinstance(spec, dict) and spec.get("type") == "tool_calls":
        from decoding.tool_constraint import ToolCallConstraint

        return ToolCallConstraint(spec, tokenizer_json, vocab_size, eos_ids)
    return TokenConstraint(spec, tokenizer_json, vocab_size, eos_ids)
