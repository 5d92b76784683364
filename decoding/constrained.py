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

:func:`make_constraint` builds the right object for a spec; both kinds answer
the same five questions (mask, advance, finished, accepting, rollback).
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
        import llguidance.torch as lt

        n = int(vocab_size or self.vocab_size)
        if n != self.vocab_size:
            raise ValueError(f"mask asked for {n} tokens; the constraint was built for {self.vocab_size}")
        if self._bits is None:
            self._bits = lt.allocate_token_bitmask(1, n)
        lt.fill_next_token_bitmask(self._matcher, self._bits, 0)
        if self._matcher.is_error():
            raise ConstraintViolated(self._matcher.get_error())
        return unpack_bitmask(self._bits[0], n)

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


def unpack_bitmask(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """llguidance's packed int32 words (bit i of word w = token 32*w + i) -> bool ``[vocab_size]``."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    unpacked = (bits.to(torch.int32).unsqueeze(-1) >> shifts) & 1
    return unpacked.reshape(-1)[:vocab_size].to(torch.bool)


def make_constraint(spec: dict[str, Any], tokenizer_json: str | Path, vocab_size: int,
                    eos_ids: tuple[int, ...]):
    """The constraint object for ``spec``: :class:`ToolCallConstraint` or :class:`TokenConstraint`."""
    cls = ToolCallConstraint if isinstance(spec, dict) and spec.get("type") == "tool_calls" else TokenConstraint
    return cls(spec, tokenizer_json, vocab_size, eos_ids)


class ToolCallConstraint:
    """Free text or calls of the offered tools; the grammar is on only where a call is written.

    Phases: ``start`` (the answer so far could still become text or a call:
    two matchers, one for each, and a token passes if either allows it),
    ``text`` (the call matcher refused a token: nothing is masked any more,
    the text is watched for the template's call tag or a JSON call after the
    words) and ``call`` (the text
    matcher refused: the call grammar masks until the answer ends). The phase
    is a function of the tokens consumed, so a rollback replays them.

    A thinking model adds ``think``: inside its ``<think>…</think>`` block
    (opened by its first token, or by the prompt when the spec's
    ``reasoning`` is ``"inside"``) nothing is masked and no call is looked
    for; after ``</think>`` the answer starts over in ``start`` (or ``call``).
    """

    _TAIL = 16  # tokens of text kept to spot a call start written across several tokens

    def __init__(self, spec: dict[str, Any], tokenizer_json: str | Path, vocab_size: int,
                 eos_ids: tuple[int, ...]):
        from decoding.tool_grammar import BadToolSpec, build

        self.spec = spec
        self.vocab_size = int(vocab_size)
        self._args = (tokenizer_json, vocab_size, eos_ids)
        self._tok = grammar_tokenizer(tokenizer_json, vocab_size, eos_ids)
        try:
            self._grammar = build(spec, self._tag_tokens())
        except BadToolSpec as exc:
            raise BadConstraint(str(exc)) from None
        self._reasoning = spec.get("reasoning")
        self._think_open, self._think_close = self._think_tokens() if self._reasoning else (None, None)
        self._consumed: list[int] = []
        self._reset()

    def _tag_tokens(self) -> dict[str, int]:
        """Tags the vocabulary holds as one special token (Qwen's ``<tool_call>``): named by id."""
        from decoding.tool_grammar import HERMES_CLOSE, HERMES_OPEN, MISTRAL_OPEN, PYTHON_TAG

        out = {}
        for tag in (HERMES_OPEN, HERMES_CLOSE, MISTRAL_OPEN, PYTHON_TAG):
            ids = self._tok.tokenize_str(tag)
            if len(ids) == 1 and self._tok.is_special_token(ids[0]):
                out[tag] = int(ids[0])
        return out

    def _think_tokens(self) -> tuple[int | None, int | None]:
        """The ids of ``<think>`` and ``</think>`` where the vocabulary holds each as one token (Qwen3 does)."""
        from decoding.tool_grammar import THINK_CLOSE, THINK_OPEN

        ids = [self._tok.tokenize_str(tag) for tag in (THINK_OPEN, THINK_CLOSE)]
        return tuple(int(i[0]) if len(i) == 1 else None for i in ids)

    def _reset(self) -> None:
        """The state before the answer's first token."""
        self._begin()
        self._may_open = self._reasoning == "start"  # until the first token: a think block may open
        if self._reasoning == "inside":
            self.phase = "think"

    def _begin(self) -> None:
        """The grammar as at the start of an answer (again after a think block)."""
        self._call: TokenConstraint | None = self._matcher(self._grammar.calls)
        self._plain = None if self._grammar.plain is None else self._matcher(self._grammar.plain)
        self.phase = "start" if self._plain is not None else "call"
        self._tail: list[int] = []

    def _matcher(self, lark: str) -> TokenConstraint:
        return TokenConstraint({"type": "lark", "grammar": lark}, *self._args)

    def allowed_mask(self, vocab_size: int | None = None) -> torch.Tensor:
        """Bool ``[vocab_size]``: True where the token may come next (all of them in text)."""
        if self.phase in ("text", "think"):
            return torch.ones(int(vocab_size or self.vocab_size), dtype=torch.bool)
        mask = self._call.allowed_mask(vocab_size)
        if self._plain is not None:
            mask = mask | self._plain.allowed_mask(vocab_size)
        if self._may_open and self._think_open is not None and self._think_open < mask.shape[0]:
            mask[self._think_open] = True
        return mask

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.phase in ("text", "think"):
            return logits  # nothing is masked while the model talks or thinks
        return logits.masked_fill(~self.allowed_mask(logits.shape[-1]), float("-inf"))

    def advance(self, token_id: int) -> None:
        tok = int(token_id)
        self._consumed.append(tok)
        opens = self._may_open and tok == self._think_open
        self._may_open = False
        if opens:
            self.phase = "think"
        elif self.phase == "think":
            self._thinking(tok)
        elif self.phase == "start":
            call_ok, plain_ok = _takes(self._call, tok), _takes(self._plain, tok)
            if not (call_ok or plain_ok):
                raise ConstraintViolated(f"token {tok} is neither text nor the start of a call here")
            if not call_ok:
                self.phase, self._call, self._plain = "text", None, None
            elif not plain_ok:
                self.phase, self._plain = "call", None
        elif self.phase == "call":
            self._call.advance(tok)
        else:
            self._watch(tok)

    def _thinking(self, tok: int) -> None:
        """Inside the think block: its end starts the answer's grammar over."""
        from decoding.tool_grammar import THINK_CLOSE

        if self._think_close is not None:
            if tok == self._think_close:
                self._begin()
            return
        self._tail = self._tail[-self._TAIL:] + [tok]
        if THINK_CLOSE in self._tok.decode_str(self._tail):
            self._begin()

    def _watch(self, tok: int) -> None:
        """Text so far: does its tail start a call (the call tag, or a JSON call after words)?"""
        from decoding.tool_grammar import INLINE_CALL

        self._tail = self._tail[-self._TAIL:] + [tok]
        text = self._tok.decode_str(self._tail)
        trigger = self._grammar.trigger
        at = text.find(trigger) if trigger else -1
        inline = INLINE_CALL.search(text) if at < 0 else None
        if at >= 0:
            self._resume(self._grammar.resume, text[at + len(trigger):])
        elif inline is not None:
            self._resume(self._grammar.inline, text[inline.start():])

    def _resume(self, grammar: str, written: str) -> None:
        """The rest of the answer is calls under ``grammar``; ``written``: its start, already sampled."""
        matcher = self._matcher(grammar)
        self._tail = []  # either way this start is settled: it is not looked at (and compiled) again
        for t in (self._tok.tokenize_str(written) if written else ()):
            if not _takes(matcher, t):
                return  # not a call after all (it cannot be finished as one): the text goes on
        self.phase, self._call = "call", matcher

    def is_finished(self) -> bool:
        return self.phase == "call" and self._call.is_finished()

    def is_accepting(self) -> bool:
        return self.phase in ("text", "think") or any(m is not None and m.is_accepting()
                                                      for m in (self._call, self._plain))

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= len(self._consumed):
            raise ValueError(f"cannot roll back {num_tokens} tokens; {len(self._consumed)} were consumed")
        if num_tokens:
            keep = self._consumed[: len(self._consumed) - num_tokens]
            self._consumed = []
            self._reset()
            for t in keep:
                self.advance(t)


def _takes(matcher: TokenConstraint | None, token: int) -> bool:
    """Advance ``matcher`` past ``token`` if it allows it; False (matcher spent) if not."""
    if matcher is None:
        return False
    try:
        matcher.advance(token)
    except ConstraintViolated:
        return False
    return True
