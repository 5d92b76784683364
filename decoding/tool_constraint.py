"""The tool-call constraint: free text, or calls of the offered tools with the grammar switched on lazily.

A ``{"type": "tool_calls", ...}`` spec (``decoding.tool_grammar`` builds its grammars)
lets a model answer in words or call a tool, and only a call is held to the grammar.
It answers the same questions as :class:`~decoding.constrained.TokenConstraint`
(mask, advance, finished, accepting, rollback; a drafter's forced draft and valid
prefix), built from up to two of them, so the sampler and the drafter cannot tell the
two kinds apart. Apart from ``decoding.constrained`` because
the phases (start, text, call, think) are a state machine of their own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from decoding.constrained import BadConstraint, ConstraintViolated, TokenConstraint, grammar_tokenizer

__all__ = ["ToolCallConstraint"]


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

    def restart(self) -> None:
        """Back to the state before the answer's first token."""
        self._consumed = []
        self._reset()

    def forced_draft(self, limit: int = 16) -> list[int]:
        """The call grammar's forced text as draft tokens; none while the answer may still be words."""
        return self._call.forced_draft(limit) if self.phase == "call" else []

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens`` may come next, in order, without moving the state.

        Words and a think block take anything. At the start a token passes if the call or
        the text grammar takes it; the text grammar refusing means a call (held to its
        grammar from there), the call grammar refusing first means words (nothing masked
        from there). Text that reaches a call tag mid-draft is taken whole: the verify
        round's mask still holds the call to its grammar, the draft is only cut shorter
        here to save its rows.
        """
        tokens = [int(t) for t in tokens]
        if self.phase in ("text", "think") or (self._may_open and tokens and tokens[0] == self._think_open):
            return len(tokens)
        if self.phase == "call":
            return self._call.valid_prefix(tokens)
        as_call, as_text = self._call.valid_prefix(tokens), self._plain.valid_prefix(tokens)
        return len(tokens) if as_text > as_call else as_call

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= len(self._consumed):
            raise ValueError(f"cannot roll back {num_tokens} tokens; {len(self._consumed)} were consumed")
        if num_tokens:
            keep = self._consumed[: len(self._consumed) - num_tokens]
            self.restart()
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
