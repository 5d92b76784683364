"""The engine seam: stop strings, EOS, max_tokens, detokenising, worker threads."""

from __future__ import annotations

import asyncio
import threading

import pytest

from meshd.engine.base import GenerationRequest, StopMatcher
from decoding.detok import IncrementalDetokenizer
from meshd.engine.errors import PromptTooLong
from meshd.engine.local import iterate_in_thread
from tests.support.api import FakeEngine
from meshd.engine.options import RequestOptions


def run_stream(engine, max_tokens=100, **options):
    req = GenerationRequest(request_id="r", prompt_ids=[1, 2, 3], max_tokens=max_tokens,
                            options=RequestOptions(**options))

    async def main():
        return [ev async for ev in engine.stream(req)]

    return asyncio.run(main())


def text_of(events):
    return "".join(e.text for e in events)


def test_stream_ends_at_eos_with_usage():
    events = run_stream(FakeEngine(reply="abc"))
    assert text_of(events) == "abc"
    assert events[-1].finish_reason == "stop"
    assert events[-1].usage.prompt_tokens == 3 and events[-1].usage.completion_tokens == 3
    assert [e.token_id for e in events[:-1]] == [ord("a"), ord("b"), ord("c")]


def test_stream_ends_at_max_tokens_and_closes_the_source():
    eng = FakeEngine(reply="abcdef")
    events = run_stream(eng, max_tokens=2)
    assert text_of(events) == "ab"
    assert events[-1].finish_reason == "length"
    assert eng.closed_early == 1 and eng.active == 0


def test_stop_string_spanning_tokens_is_cut_and_not_emitted():
    eng = FakeEngine(reply="one two three")
    events = run_stream(eng, stop=("two",))
    assert text_of(events) == "one "
    assert events[-1].finish_reason == "stop"
    assert events[-1].usage.completion_tokens == len("one two")
    assert eng.closed_early == 1


def test_text_that_only_looks_like_a_stop_prefix_is_released():
    events = run_stream(FakeEngine(reply="tw tx"), stop=("twice",))
    assert text_of(events) == "tw tx"
    assert events[-1].finish_reason == "stop"


def test_earliest_of_several_stop_strings_wins():
    assert text_of(run_stream(FakeEngine(reply="a-b+c"), stop=("+", "-"))) == "a"


def test_prompt_filling_the_context_is_refused_before_generation():
    eng = FakeEngine(context_length=3)
    with pytest.raises(PromptTooLong):
        run_stream(eng)
    assert eng.started == 0


@pytest.mark.parametrize("pieces, stops, expected", [
    (["Hel", "lo ", "wor", "ld"], ["wor"], "Hello "),
    (["ab", "c"], ["abc"], ""),
    (["a", "b"], ["bc"], "ab"),
    (["xSTO", "P"], ["STOP"], "x"),
    (["no stops here"], [], "no stops here"),
])
def test_stop_matcher(pieces, stops, expected):
    m = StopMatcher(stops)
    out = "".join(m.feed(p) for p in pieces) + m.flush()
    assert out == expected


def test_stop_matcher_never_emits_a_partial_stop_before_deciding():
    m = StopMatcher(["END"])
    assert m.feed("abcE") == "abc"
    assert m.feed("N") == ""
    assert m.feed("x") == "ENx"


class ByteTokenizer:
    """UTF-8 bytes as tokens: a character can span several tokens."""

    eos_ids = ()

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def test_detokenizer_holds_back_partial_multibyte_characters():
    d = IncrementalDetokenizer(ByteTokenizer())
    deltas = [d.push(b) for b in "a€b".encode()]
    assert deltas == ["a", "", "", "€", "b"]
    assert d.flush() == ""


def test_detokenizer_flush_drops_an_incomplete_trailing_character():
    d = IncrementalDetokenizer(ByteTokenizer())
    assert [d.push(b) for b in "x€".encode()[:2]] == ["x", ""]
    assert d.flush() == ""


def test_iterate_in_thread_streams_items_and_propagates_errors():
    def make(cancel):
        yield 1
        yield 2
        raise ValueError("boom")

    async def main():
        got = []
        with pytest.raises(ValueError, match="boom"):
            async for x in iterate_in_thread(make):
                got.append(x)
        return got

    assert asyncio.run(main()) == [1, 2]


def test_closing_iterate_in_thread_cancels_the_worker_and_waits_for_it():
    stopped = threading.Event()

    def make(cancel):
        try:
            i = 0
            while not cancel.is_set():
                i += 1
                yield i
                cancel.wait(0.001)
        finally:
            stopped.set()

    async def main():
        agen = iterate_in_thread(make)
        assert await anext(agen) == 1
        await agen.aclose()
        return stopped.is_set()

    assert asyncio.run(main()) is True
