"""Prompt-lookup drafting: continue the text the way it continued before.

Answers that quote their input — a summary of a home's event log, an edit of
a config snippet, a list that repeats a pattern — contain long runs already
present in the prompt or in the answer so far. Find the most recent earlier
occurrence of the last n tokens (longest n first) and propose what followed
it. Costs no model compute; proposals that never match cost one verify
round's extra tokens, which the adaptive controller stops paying for.
"""

from __future__ import annotations

from collections.abc import Sequence


class LookupDrafter:
    """Incremental n-gram index over one request's tokens (prompt + committed answer)."""

    name = "lookup"

    def __init__(self, tokens: Sequence[int] = (), max_ngram: int = 4, min_ngram: int = 1,
                 max_branches: int = 3):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram, self.max_branches = max_ngram, min_ngram, max_branches
        self.tokens: list[int] = []
        # n-gram -> end positions (exclusive) of its occurrences, oldest first
        self._index: dict[tuple[int, ...], list[int]] = {}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.tokens.append(int(t))
            end = len(self.tokens)
            for n in range(self.min_ngram, self.max_ngram + 1):
                if end >= n:
                    self._index.setdefault(tuple(self.tokens[end - n:end]), []).append(end)

    def propose(self, length: int, after: Sequence[int] = ()) -> list[list[int]]:
        """Up to ``max_branches`` distinct continuations (each ≤ ``length`` tokens) of the
        tokens so far, best first: longer matching n-gram first, then the most recent.

        ``after``: tokens taken as already following (a grammar's forced text): the
        continuations are of the tokens so far plus these, which are not indexed."""
        if length <= 0 or not self.tokens:
            return []
        out: list[list[int]] = []
        seen: set[int] = set()  # first tokens already proposed: branches must differ
        text = self.tokens + [int(t) for t in after] if after else self.tokens
        total = len(text)
        for n in range(min(self.max_ngram, total), self.min_ngram - 1, -1):
            ends = self._index.get(tuple(text[total - n:]), [])
            for end in reversed(ends):
                if end >= total:  # the suffix itself
                    continue
                cont = self.tokens[end:end + length]
                if cont and cont[0] not in seen:
                    seen.add(cont[0])
                    out.append(cont)
                    if len(out) >= self.max_branches:
                        return out
        return out
