"""A thinking model's reasoning, split from its spoken answer as the text streams.

Qwen3 (and models like it) write ``<think>…</think>`` before they answer. That
text is the model reasoning with itself: a voice assistant must never say it,
so it goes to OpenAI's ``reasoning_content`` and Ollama's ``thinking``, and
only what follows ``</think>`` is the answer's ``content``.

:class:`ReasoningSplitter` takes the answer in whatever pieces the engine
produced (a tag may be split across several) and hands back, per piece, the
reasoning and the content that are safe to send: a tail that could still be
the start of a tag is held until the next piece decides it. A think block is
recognised only where the model writes it, at the very start of the answer
(after blank space), or from the first token when the prompt already opened it
(Qwen3's Thinking-2507 template ends the prompt with ``<think>\\n``). Blank
space around the reasoning and between ``</think>`` and the answer is dropped,
as Ollama does; an answer without a think block passes through unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class Split:
    """What one piece of the answer holds that can be sent now."""

    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)

    def __add__(self, other: Split) -> Split:
        return Split(self.reasoning + other.reasoning, self.content + other.content)


class ReasoningSplitter:
    """Splits one answer's text into reasoning and content, piece by piece (see the module)."""

    def __init__(self, inside: bool = False):
        """``inside``: the prompt opened the think block, so the answer starts as reasoning."""
        self._state = "reasoning" if inside else "start"
        self._held = ""
        self._reasoned = False  # some reasoning was sent (later leading blank space is the model's)

    def feed(self, text: str) -> Split:
        self._held += text
        if self._state == "start":
            probe = self._held.lstrip()
            if probe.startswith(OPEN):
                self._state, self._held = "reasoning", probe[len(OPEN):]
            elif OPEN.startswith(probe):
                return Split()  # blank, or a tag still arriving
            else:
                self._state = "plain"
        if self._state == "reasoning":
            return self._reasoning()
        if self._state == "after":
            self._held = self._held.lstrip()
            if not self._held:
                return Split()
            self._state = "plain"
        out, self._held = self._held, ""
        return Split(content=out)

    def _reasoning(self) -> Split:
        if not self._reasoned:
            self._held = self._held.lstrip()
        at = self._held.find(CLOSE)
        if at >= 0:
            thought, rest = self._held[:at].rstrip(), self._held[at + len(CLOSE):]
            self._state, self._held = "after", ""
            self._reasoned = self._reasoned or bool(thought)
            return Split(reasoning=thought) + self.feed(rest)
        keep = _partial_tag_at(self._held, CLOSE)
        while keep > 0 and self._held[keep - 1].isspace():
            keep -= 1  # blank space may be the end of the reasoning: held until more words come
        out, self._held = self._held[:keep], self._held[keep:]
        self._reasoned = self._reasoned or bool(out)
        return Split(reasoning=out)

    def finish(self) -> Split:
        """What is still held once the answer ended (a think block never closed is all reasoning)."""
        held, self._held = self._held, ""
        if self._state == "reasoning":
            return Split(reasoning=held.rstrip() if self._reasoned else held.strip())
        if self._state == "after":
            return Split()
        return Split(content=held)


def split_whole(text: str, inside: bool = False) -> Split:
    """A whole answer, split at once (a non-streamed reply)."""
    splitter = ReasoningSplitter(inside)
    return splitter.feed(text) + splitter.finish()


def _partial_tag_at(text: str, tag: str) -> int:
    """Where a suffix of ``text`` that is a proper prefix of ``tag`` begins (``len(text)`` if none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return len(text) - n
    return len(text)


def thinks(tokenizer: Any) -> bool:
    """Whether the model's chat template teaches think blocks (so its answers are split)."""
    return bool(getattr(tokenizer, "supports_thinking", False))


def prompt_opens_reasoning(tokenizer: Any, prompt_ids: list[int]) -> bool:
    """Whether the prompt ends inside a think block the template opened (Qwen3 Thinking-2507)."""
    tail = tokenizer.decode(prompt_ids[-16:], skip_special=False)
    return tail.rfind(OPEN) > tail.rfind(CLOSE)


def reasoning_start(tokenizer: Any, prompt_ids: list[int] | None) -> str | None:
    """Where a chat answer's think block stands: "inside" (the prompt opened it), "start" (the answer
    may open it), None (the model does not think). The splitter and the tool grammar both follow it."""
    if prompt_ids is None or not thinks(tokenizer):
        return None
    return "inside" if prompt_opens_reasoning(tokenizer, prompt_ids) else "start"


def splitter_for(tokenizer: Any, prompt_ids: list[int] | None) -> ReasoningSplitter | None:
    """The splitter for a chat answer of this model, or None when the model does not think."""
    start = reasoning_start(tokenizer, prompt_ids)
    return None if start is None else ReasoningSplitter(inside=start == "inside")
