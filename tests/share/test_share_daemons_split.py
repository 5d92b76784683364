"""Real daemons and a split GGUF: a member serving the embedded model as a 3-part set lends a newcomer
with no model the layers its plan gives it, and the home answers exactly like one device.

As ``test_share_daemons.py``, with the model split the way the Hub publishes 7B+ files: the
newcomer's cache holds the three parts as sparse files, and its identity is the set's.
"""

from __future__ import annotations

import json

import pytest

from decoding.generate import generate
from decoding.loader import open_model
from decoding.pipeline_local import LocalPipeline
from meshd.client import MeshdClient
from tests.support.daemons import HALF_THE_MODEL, summary
from tests.support.gguf_split import split_gguf
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

DEAD = "http://127.0.0.1:9"  # nothing listens on the discard port: every index or hub request fails


def stages(proc) -> list[dict]:
    return (proc.status().get("plan") or {}).get("stages") or []


def warm_plan_over(procs, n) -> bool:
    st = [p.status() for p in procs]
    versions = {(s.get("plan") or {}).get("version") for s in st}
    return len(versions) == 1 and all(s.get("ready") for s in st) and len(stages(procs[0])) == n


@pytest.mark.timeout(600)
def test_a_split_set_is_lent_by_layer_range_between_real_daemons(mesh, real_source, served_stage, tmp_path):
    parts = split_gguf(real_source.path, tmp_path / "smol.gguf", parts=3)
    identity = open_model(parts[0]).identity
    a = mesh.spawn("alpha", "--model", str(parts[0]), *HALF_THE_MODEL, new_home="split-home")
    a.wait_serving(120)
    home = mesh.root / "beta-meshd-home"
    b = mesh.spawn("beta", "--model", "", *HALF_THE_MODEL, token=mesh.invite(a),
                   env={"MESHD_HOME": str(home), "PIP_INDEX_URL": DEAD + "/simple", "HF_ENDPOINT": DEAD,
                        "HTTP_PROXY": DEAD, "HTTPS_PROXY": DEAD, "http_proxy": DEAD, "https_proxy": DEAD})
    wait_until(lambda: warm_plan_over([a, b], 2), 300, what="a warm two-stage plan",
               explain=lambda: summary(a, b) + "\n" + json.dumps((b.status().get("sharing") or {}).get("fetch")))
    sh = b.status()["sharing"]
    assert sh["model"] == identity and not sh["holds"]["complete"]
    [entry] = [d for d in (b.state_dir / "models").iterdir() if d.is_dir() and not d.name.startswith(".")]
    assert sorted(p.name for p in entry.glob("*.gguf")) == [p.name for p in parts]
    assert sum(p.stat().st_blocks * 512 for p in entry.glob("*.gguf")) < sum(p.stat().st_size for p in parts)
    assert a.status()["sharing"]["served"]["bytes"] > 0
    tok = real_source.tokenizer
    question = "What is the capital of France?"
    ids = tok.apply_chat([{"role": "user", "content": question}])
    want = generate(LocalPipeline([served_stage]), ids, 16, eos_ids=tok.eos_ids, tokenizer=tok).text
    for proc in (a, b):
        got = MeshdClient(proc.socket, timeout=240).chat(question, max_tokens=16, temperature=0).text
        assert got == want, summary(a, b)
