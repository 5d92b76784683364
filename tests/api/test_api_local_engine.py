"""LocalEngine: the real embedded model served through the API."""

from __future__ import annotations

import httpx
import openai
import pytest

from meshd.engine.local import LocalEngine
from tests.support.api import ServerThread

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def local_engine(real_source):
    eng = LocalEngine(real_source)
    yield eng
    eng.close()


def test_local_engine_streams_the_reference_greedy_answer_through_the_api(local_engine, real_source):
    from decoding.generate import generate
    from decoding.pipeline_local import LocalPipeline

    tok = real_source.tokenizer
    ref = generate(LocalPipeline(local_engine._pipeline.stages), tok.apply_chat(QUESTION),
                   MAX_TOKENS, eos_ids=tok.eos_ids, tokenizer=tok)

    with ServerThread(local_engine) as srv:
        client = openai.OpenAI(
            base_url="http://localhost/v1", api_key="unused", max_retries=0,
            http_client=httpx.Client(transport=httpx.HTTPTransport(uds=str(srv.socket_path))),
        )
        chunks = list(client.chat.completions.create(
            model=local_engine.model_id, messages=QUESTION, stream=True,
            max_tokens=MAX_TOKENS, temperature=0, stream_options={"include_usage": True},
        ))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    assert text.strip()
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert chunks[-2].choices[0].finish_reason == ref.finish_reason


def test_seeded_sampling_is_repeatable_and_stop_strings_apply(local_engine):
    with ServerThread(local_engine) as srv:
        client = openai.OpenAI(
            base_url="http://localhost/v1", api_key="unused", max_retries=0,
            http_client=httpx.Client(transport=httpx.HTTPTransport(uds=str(srv.socket_path))),
        )

        def ask(**kw):
            return client.chat.completions.create(model="meshd", messages=QUESTION,
                                                  max_tokens=MAX_TOKENS, **kw).choices[0]

        a, b = ask(temperature=0.9, seed=5), ask(temperature=0.9, seed=5)
        assert a.message.content == b.message.content
        greedy = ask(temperature=0).message.content
        cut = greedy.split()[1] if len(greedy.split()) > 1 else greedy[-1]
        stopped = ask(temperature=0, stop=[cut])
        assert cut not in stopped.message.content
        assert greedy.startswith(stopped.message.content)
        assert stopped.finish_reason == "stop"


def test_concurrent_requests_queue_and_a_hang_up_frees_the_cache(local_engine):
    import asyncio

    from meshd.client import AsyncMeshdClient
    from tests.support.waiting import wait_until

    with ServerThread(local_engine) as srv:
        async def main():
            async with AsyncMeshdClient(srv.socket_path) as c:
                answers = await asyncio.gather(*[
                    c.chat(QUESTION, max_tokens=MAX_TOKENS, temperature=0) for _ in range(3)])
                stream = await c.chat(QUESTION, stream=True, max_tokens=500, temperature=0)
                async for _ in stream:
                    break
                await stream.aclose()
                return answers

        answers = asyncio.run(main())
        assert len({a.text for a in answers}) == 1 and answers[0].text
        caches = local_engine._pipeline.caches
        assert wait_until(lambda: not local_engine._lock.locked()
                          and all(c.sequences() == [] for c in caches))


def test_daemon_factory_opens_the_configured_model(monkeypatch):
    import asyncio
    from types import SimpleNamespace

    from meshd.engine import local as engine_mod

    opened = []

    async def fake_open(path=None, **kw):
        opened.append(path)
        return "engine"

    monkeypatch.setattr(engine_mod.LocalEngine, "open", fake_open)
    config = SimpleNamespace(model="/models/x.gguf")
    assert asyncio.run(engine_mod.local_engine(config)) == "engine"
    assert opened == ["/models/x.gguf"]
