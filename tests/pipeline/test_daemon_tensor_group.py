"""Two real daemons planned as one tensor-parallel group: every layer split between them, answering as the
in-process group does, and a member that leaves mid-answer never breaks the stream."""

import signal

import pytest
import torch

from decoding.quant import native
from tests.support.clients import sdk
from tests.support.daemons import Mesh, summary
from tests.support.tensor_group import run_group
from tests.support.waiting import wait_until

OK, WHY = native.available()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not OK, reason=f"integer kernels unavailable: {WHY}")]
QUESTION = "What is the capital of France?"


def group_of(proc) -> list[str]:
    for s in (proc.status().get("plan") or {}).get("stages") or []:
        if s.get("tensor_group"):
            return list(s["tensor_group"])
    return []


@pytest.fixture(scope="module")
def group(real_source):
    mesh = Mesh()
    try:
        a, b = mesh.pair("tensor-test", "--model", str(real_source.path), "--layout", "tensor")

        def formed() -> bool:
            sa, sb = a.status(), b.status()
            return (len(group_of(a)) == 2 and (sa.get("plan") or {}).get("version") ==
                    (sb.get("plan") or {}).get("version") and bool(sa.get("ready")))
        wait_until(formed, 180, what="a warm plan of one tensor group", explain=lambda: summary(a, b))
        yield mesh, a, b
    finally:
        mesh.cleanup()


def reference_tokens(real_source, question: str, steps: int, speeds, attention: str) -> list[int]:
    """The in-process two-member group's greedy tokens for the chat, split by the plan's speeds and held as
    it holds the attention (the daemons' exact reference: another split adds its partial sums in another
    order)."""
    tok = real_source.tokenizer
    whole = real_source.load_stage(0, real_source.config.num_layers, torch.float32, packed="gguf")
    ids = torch.tensor(tok.apply_chat([{"role": "user", "content": question}]))
    _, tokens = run_group(whole, 2, ids, steps, tuple(speeds), attention=attention)[0]
    out = []
    for t in tokens:
        if t in tok.eos_ids:
            break
        out.append(t)
    return out


def test_two_daemons_split_every_layer_and_answer_as_the_in_process_group(group, real_source):
    _, a, b = group
    plan = a.status()["plan"]
    (stage,) = plan["stages"]
    assert plan["layout"] == "tensor" and plan.get("weights") == "gguf"
    assert stage["tensor_group"] == group_of(b) and len(stage["tensor_group"]) == 2
    reply = sdk(a.socket, timeout=240).chat.completions.create(
        model="meshd", messages=[{"role": "user", "content": QUESTION}], max_tokens=16, temperature=0)
    want = real_source.tokenizer.decode(reference_tokens(real_source, QUESTION, 16, stage["tensor_speeds"],
                                                    stage["tensor_attention"]))
    assert reply.choices[0].message.content == want
    # and through the follower's own API: it routes to the group's first member
    again = sdk(b.socket, timeout=240).chat.completions.create(
        model="meshd", messages=[{"role": "user", "content": QUESTION}], max_tokens=16, temperature=0)
    assert again.choices[0].message.content == want


def test_a_grammar_masks_the_groups_gathered_logits(group):
    """Structured output (as every Home Assistant request is, under its tool grammar) through the group:
    the grammar runs over the whole rows the first member gathered."""
    import json

    _, a, _ = group
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    reply = sdk(a.socket, timeout=240).chat.completions.create(
        model="meshd", messages=[{"role": "user", "content": "Which city is the capital of France? Answer in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        max_tokens=32, temperature=0)
    assert isinstance(json.loads(reply.choices[0].message.content)["city"], str)


def test_a_member_that_leaves_mid_answer_leaves_the_stream_whole(group):
    """The follower is killed while the answer streams: the request replays on what is left (alpha alone)
    and the stream goes on from the tokens already sent."""
    mesh, a, b = group
    stream = sdk(a.socket, timeout=300).chat.completions.create(
        model="meshd", messages=[{"role": "user", "content": "Write a long story about a lighthouse keeper."}],
        max_tokens=96, temperature=0, stream=True)
    text, killed = "", False
    for chunk in stream:
        text += chunk.choices[0].delta.content or "" if chunk.choices else ""
        if not killed and len(text) > 40:
            b.proc.send_signal(signal.SIGKILL)
            killed = True
    assert killed and len(text) > 60
    wait_until(lambda: not group_of(a), 120, what="a plan without the lost member", explain=lambda: summary(a))
