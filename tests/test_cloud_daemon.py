"""A home daemon paired with a cloud verifier, as a user runs them: two processes, the CLI, the SDK.

`meshd cloud serve` in one process, `meshd cloud invite` / `meshd cloud pair` from the CLI,
a real `meshd join` daemon, the openai SDK as the client. The verifier runs the embedded
model too, so at budget 1.0 the answer must be exactly the model's own greedy answer; then
the verifier is killed and the next answer completes locally.
"""

import json
import signal
import subprocess
import sys

import pytest

from decoding.generate import generate
from decoding.pipeline_local import LocalPipeline
from meshd.state import StateDir
from tests.test_daemon_helpers import ROOT, Mesh, run_cli, wait_for
from tests.test_daemon_serving import _openai_over

pytestmark = pytest.mark.slow


def test_a_paired_home_answers_with_the_verifiers_tokens_and_carries_on_without_it(real_source, real_stage):
    tok = real_source.tokenizer
    question = "Name two planets of the solar system."
    want = generate(LocalPipeline([real_stage]), tok.apply_chat([{"role": "user", "content": question}]), 24,
                    eos_ids=tok.eos_ids, tokenizer=tok).text
    mesh = Mesh()
    cloud_dir = mesh.root / "cloud"
    log = open(mesh.root / "verifier.log", "ab")
    verifier = subprocess.Popen([sys.executable, "-m", "meshd", "cloud", "serve", "--model", str(real_source.path),
                                 "--state-dir", str(cloud_dir), "--listen", "127.0.0.1", "--port", "0",
                                 "--pairing-port", "0"], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=mesh.env())
    try:
        info = wait_for(lambda: json.loads((cloud_dir / "verifier.json").read_text()), 120,
                        what="the verifier to listen", explain=lambda: (mesh.root / "verifier.log").read_text()[-2000:])
        rc, out = run_cli("cloud", "invite", "--state-dir", str(cloud_dir), "--json")
        assert rc == 0, out
        token = json.loads(out.strip().splitlines()[-1])["token"]
        # A long verdict timeout: the suite runs with both cores busy, and this test checks exactness.
        a = mesh.spawn("alpha", "--model", str(real_source.path), "--cloud-budget", "1.0", "--cloud-min-timeout",
                       "15", new_home="cloud-home", start=False)
        StateDir(a.state_dir).ensure().create_home("cloud-home")
        rc, out = run_cli("cloud", "pair", f"127.0.0.1:{info['pairing_port']}", token, "--state-dir",
                          str(a.state_dir))
        assert rc == 0 and "paired" in out, out
        a.start()
        wait_for(lambda: a.status().get("ready"), 120, what="alpha to serve", explain=a.log_tail)

        client = _openai_over(a.socket)
        resp = client.chat.completions.create(model="any", messages=[{"role": "user", "content": question}],
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
        resp = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Say hello."}],
                                              max_tokens=16, temperature=0, extra_body={"cloud": 1.0})
        assert resp.choices[0].message.content and resp.choices[0].finish_reason in ("stop", "length")
        usage = resp.usage.model_dump()
        assert usage["cloud"]["local_fallbacks"] >= 1
        link = a.status()["stage"]["cloud"]["link"]
        assert link["state"] != "connected" and link["last_error"]
        wait_for(lambda: (a.status().get("stage") or {}).get("kv_tokens_in_use") == 0, 30, what="every sequence freed")
    finally:
        if verifier.poll() is None:
            verifier.kill()
        log.close()
        mesh.cleanup()
