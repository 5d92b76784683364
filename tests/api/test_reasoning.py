"""The reasoning splitter: a think block goes to reasoning, the rest to content, however the text arrives.

Each case is fed whole, one character at a time (every tag split across
pieces) and cut at every single place; all must give the same split.
"""

from __future__ import annotations

import pytest

from meshd.api.reasoning import ReasoningSplitter, Split, split_whole

CASES = [  # (answer, prompt opened the block, reasoning, content)
    ("<think>\nThe user wants the light on.\n</think>\n\nIt is on.", False, "The user wants the light on.", "It is on."),
    ("\n<think>a < b and </th are not tags</think>\nYes.", False, "a < b and </th are not tags", "Yes."),
    ("<think>\n\n</think>\n\nHi", False, "", "Hi"),
    ("<think>one\n\ntwo\n</think>b</think>c", False, "one\n\ntwo", "b</think>c"),
    ("<think>\nstill thinking when the tokens ran out\n", False, "still thinking when the tokens ran out", ""),
    ("Hello <think> is only a word here", False, "", "Hello <think> is only a word here"),
    ("  Hello, no think block.\n", False, "", "  Hello, no think block.\n"),
    ("<thi", False, "", "<thi"),
    ("<think>a</thi", False, "a</thi", ""),
    ("Okay, the user wants the light.\n</think>\n\nDone.", True, "Okay, the user wants the light.", "Done."),
    ("\n", False, "", "\n"),
    ("", True, "", ""),
]


def _streamed(pieces: list[str], inside: bool) -> Split:
    s = ReasoningSplitter(inside)
    out = Split()
    for p in pieces:
        out += s.feed(p)
    return out + s.finish()


@pytest.mark.parametrize("text,inside,reasoning,content", CASES)
def test_an_answer_splits_the_same_whole_char_by_char_and_cut_anywhere(text, inside, reasoning, content):
    expected = Split(reasoning, content)
    assert split_whole(text, inside) == expected
    assert _streamed(list(text), inside) == expected
    for i in range(len(text) + 1):
        assert _streamed([text[:i], text[i:]], inside) == expected, i


def test_reasoning_streams_as_it_comes_and_only_a_possible_tag_is_held():
    s = ReasoningSplitter()
    assert s.feed("<thi") == Split()  # might be the tag
    assert s.feed("nk>\nLet me") == Split(reasoning="Let me")
    assert s.feed(" see.\n</") == Split(reasoning=" see.")  # the newline and "</" wait
    assert s.feed("think>\n\nThe ") == Split(content="The ")
    assert s.feed("light is on.") == Split(content="light is on.")
    assert s.finish() == Split()


def test_content_never_holds_back_once_the_answer_is_plain():
    s = ReasoningSplitter()
    assert s.feed("Sure") == Split(content="Sure")
    assert s.feed(" <think>") == Split(content=" <think>")
