"""A home daemon paired with a cloud verifier, as a user runs them: two processes, the CLI, the SDK.

`meshd cloud serve` in one process, `meshd cloud invite` / `meshd cloud pair` from the CLI,
a real `meshd join` daemon, the openai SDK as the client. The verifier runs the embedded
model too, so at budget 1.0 the answer must be exactly the model's own greedy answer; then
the verifier is killed and the next answer completes locally.
"""

import contextlib
import json
import signal
import subprocess
import sys

import pytest

from decoding.generate import generate
from decoding.pipeline_local import LocalPipeline
from meshd.state import StateDir
from tests.support.daemons import HALF_THE_MODEL, Mesh, run_cli
from tests.support.repo import ROOT
from tests.support.waiting import wait_until
from tests.support.clients import sdk

pytestmark = pytest.mark.slow


def _greedy(real_source, real_stage, question: str, max_tokens: int) -> str:
    """The verifier's greedy answer (it computes in float32): what budget 1.0 must give, whoever drafts."""
    tok = real_source.tokenizer
    return generate(LocalPipeline([real_stage]), tok.apply_chat([{"role": "user", "content": question}]),
                    max_tokens, eos_ids=tok.eos_ids, tokenizer=tok).text


@contextlib.contextmanager
def _mesh_with_verifier(real_source):
    """A Mesh for home daemons and `meshd cloud serve` (the embedded model) beside it; killed after."""
    mesh = Mesh()
    cloud_dir = mesh.root / "cloud"
    log = open(mesh.root / "verifier.log", "ab")
    verifier = subprocess.Popen([sys.executable, "-m", "meshd", "cloud", "serve", "--model", str(real_source.path),
                                 "--state-dir", str(cloud_dir), "--listen", "127.0.0.1", "--port", "0",
                                 "--pairing-port", "0"], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=mesh.env())
    try:
        yield mesh, cloud_dir, verifier
    finally:
        if verifier.poll() is None:
            verifier.kill()
        log.close()
        mesh.cleanup()


def _pair(mesh, cloud_dir, member_state_dir) -> dict:
    """`meshd cloud invite` at the verifier, then `meshd cloud pair` on a member; the verifier's ports."""
    info = wait_until(lambda: json.loads((cloud_dir / "verifier.json").read_text()), 120,
                      what="the verifier to listen", explain=lambda: (mesh.root / "verifier.log").read_text()[-2000:])
    rc, out = run_cli("cloud", "invite", "--state-dir", str(cloud_dir), "--json")
    assert rc == 0, out
    token = json.loads(out.strip().splitlines()[-1])["token"]
    rc, out = run_cli("cloud", "pair", f"127.0.0.1:{info['pairing_port']}", token, "--state-dir",
                      str(member_state_dir))
    assert rc == 0 and "paired" in out, out
    return info


def test_a_paired_home_answers_with_the_verifiers_tokens_and_carries_on_without_it(real_source, real_stage):
    question = "Name two planets of the solar system."
    want = _greedy(real_source, real_stage, question, 24)
    with _mesh_with_verifier(real_source) as (mesh, cloud_dir, verifier):
        # A long verdict timeout: the suite runs with both cores busy, and this test checks exactness.
        a = mesh.spawn("alpha", "--model", str(real_source.path), "--cloud-budget", "1.0", "--cloud-min-timeout",
                       "15", new_home="cloud-home", start=False)
        StateDir(a.state_dir).ensure().create_home("cloud-home")
        _pair(mesh, cloud_dir, a.state_dir)
        a.start()
        wait_until(lambda: a.status().get("ready"), 120, what="alpha to serve", explain=a.log_tail)

        client = sdk(a.socket, timeout=240)
        resp = client.chat.completions.create(model="meshd", messages=[{"role": "user", "content": question}],
                                              max_tokens=24, temperature=0, extra_body={"cloud": 1.0})
        assert resp.choices[0].message.content == want
        usage = resp.usage.model_dump()
        assert usage["cloud"]["verified"] >= 1 and usage["cloud"]["verified"] == usage["cloud"]["chunks"]
        cloud = a.status()["stage"]["cloud"]
        assert cloud["link"]["state"] == "connected" and cloud["totals"]["requests"] == 1
        rc, out = run_cli("status", "--socket", str(a.socket))
        assert "cloud verifier" in out and "connected" in out, out

        verifier.send_signal(signal.SIGKILL)  # the cloud vanishes
        verifier.wait(10)
        resp = client.chat.completions.create(model="meshd", messages=[{"role": "user", "content": "Say hello."}],
                                              max_tokens=16, temperature=0, extra_body={"cloud": 1.0})
        assert resp.choices[0].message.content and resp.choices[0].finish_reason in ("stop", "length")
        usage = resp.usage.model_dump()
        assert usage["cloud"]["local_fallbacks"] >= 1
        link = a.status()["stage"]["cloud"]["link"]
        assert link["state"] != "connected" and link["last_error"]
        wait_until(lambda: (a.status().get("stage") or {}).get("kv_tokens_in_use") == 0, 30, what="every sequence freed")


def test_pairing_one_member_pairs_the_running_home_and_a_device_that_joins_later_is_admitted(real_source,
                                                                                            real_stage):
    """`meshd cloud pair` on alpha while it runs; beta joins afterwards, learns the pairing from
    alpha's heartbeats, is vouched for at the verifier, and answers with the verifier's tokens;
    `meshd cloud unpair` on beta unpairs alpha too. No daemon is restarted."""
    import openai

    from tests.support.daemons import both_ready
    from tests.support.daemons import summary
    from transport.keys import AllowList

    question = "Name two colours of the rainbow."
    want = _greedy(real_source, real_stage, question, 16)
    with _mesh_with_verifier(real_source) as (mesh, cloud_dir, _):
        model = str(real_source.path)
        a = mesh.spawn("alpha", "--model", model, "--cloud-min-timeout", "15", *HALF_THE_MODEL,
                       new_home="shared-cloud")
        a.wait_serving(60)
        wait_until(lambda: a.status().get("ready"), 120, what="alpha to serve", explain=a.log_tail)
        info = _pair(mesh, cloud_dir, a.state_dir)  # while alpha runs
        cloud_of = lambda p: ((p.status().get("stage") or {}).get("cloud") or {})  # noqa: E731
        # "idle": a CloudHome is connected and its link has not been used yet ("not connected" otherwise).
        using = lambda p: cloud_of(p).get("link", {}).get("state") in ("idle", "connected")  # noqa: E731
        wait_until(lambda: using(a) and cloud_of(a)["link"]["address"] == f"tcp://127.0.0.1:{info['port']}", 60,
                   what="alpha to pick the pairing up without a restart", explain=a.log_tail)

        b = mesh.spawn("beta", "--model", model, "--cloud-min-timeout", "15", *HALF_THE_MODEL, token=mesh.invite(a))
        b.wait_serving(60)
        wait_until(lambda: both_ready(a, b), 120, what="a two-member plan", explain=lambda: summary(a, b))
        beta_key = StateDir(b.state_dir).keypair().public
        wait_until(lambda: beta_key in AllowList.for_state_dir(cloud_dir), 60,
                   what="alpha to vouch for beta at the verifier", explain=a.log_tail)
        wait_until(lambda: using(b), 60, what="beta to learn the pairing and connect", explain=b.log_tail)

        client = sdk(b.socket, timeout=240)
        resp = client.chat.completions.create(model="meshd", messages=[{"role": "user", "content": question}],
                                              max_tokens=16, temperature=0, extra_body={"cloud": 1.0})
        assert resp.choices[0].message.content == want
        usage = resp.usage.model_dump()["cloud"]
        assert usage["verified"] >= 1 and usage["verified"] == usage["chunks"], usage

        rc, out = run_cli("cloud", "unpair", "--state-dir", str(b.state_dir))
        assert rc == 0 and "unpaired" in out, out
        wait_until(lambda: not cloud_of(a), 60, what="alpha to learn of the unpairing", explain=a.log_tail)
        with pytest.raises(openai.BadRequestError, match="not paired"):
            sdk(a.socket, timeout=240).chat.completions.create(
                model="meshd", messages=[{"role": "user", "content": question}], max_tokens=4,
                extra_body={"cloud": 1.0})
