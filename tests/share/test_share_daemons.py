"""Real daemons: devices that join with no model and no reachable package index get their layers from
the home, serve them, and answer exactly like one device; a fetch killed halfway resumes.

The joining daemons run with an empty ``MESHD_HOME`` and every package-index route broken (an index
URL and proxies pointing at a closed port): whatever they serve came over the home's CURVE links.
"""

from __future__ import annotations

import json

import pytest

from decoding.generate import generate
from decoding.pipeline_local import LocalPipeline
from meshd.client import MeshdClient
from meshd.share import manifest as mf
from meshd.share import manifest_build as mb
from tests.support.daemons import HALF_THE_MODEL, kill_hard, run_cli, summary
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

DEAD = "http://127.0.0.1:9"  # nothing listens on the discard port: every index or hub request fails


def no_index_env(home) -> dict:
    return {"MESHD_HOME": str(home), "PIP_INDEX_URL": DEAD + "/simple", "PIP_EXTRA_INDEX_URL": "",
            "HTTP_PROXY": DEAD, "HTTPS_PROXY": DEAD, "http_proxy": DEAD, "https_proxy": DEAD,
            "ALL_PROXY": DEAD, "NO_PROXY": "", "no_proxy": ""}


def stages(proc) -> list[dict]:
    return (proc.status().get("plan") or {}).get("stages") or []


def layers_of(proc, node_id) -> tuple[int, int] | None:
    for s in stages(proc):
        if s["node_id"] == node_id:
            return tuple(s["layers"])
    return None


def warm_plan_over(procs, n) -> bool:
    st = [p.status() for p in procs]
    versions = {(s.get("plan") or {}).get("version") for s in st}
    return len(versions) == 1 and all(s.get("ready") for s in st) and len(stages(procs[0])) == n


@pytest.fixture(scope="module")
def manifest(real_source):
    return mb.build(real_source.path, reader=real_source.gguf_files[0])


@pytest.fixture(scope="module")
def answer(real_source, served_stage):
    tok = real_source.tokenizer
    cache = {}

    def ref(question: str, max_tokens: int = 16) -> str:
        if (question, max_tokens) not in cache:
            ids = tok.apply_chat([{"role": "user", "content": question}])
            cache[(question, max_tokens)] = generate(LocalPipeline([served_stage]), ids, max_tokens,
                                                     eos_ids=tok.eos_ids, tokenizer=tok).text
        return cache[(question, max_tokens)]
    return ref


def sharing(proc) -> dict:
    return proc.status().get("sharing") or {}


def assert_fetched_only_from_the_home(proc, home):
    events = [e.get("event") for e in proc.events()]
    assert "share_model_chosen" in events or "share_model_cached" in events
    assert "model_pull_download" not in events and "model_pulled" not in events
    assert not (home / "models").exists() or not any((home / "models").iterdir()), "nothing came from an index"


def test_two_devices_without_the_model_get_their_layers_from_the_home_and_answer_like_one_device(
        mesh, real_source, manifest, answer):
    a = mesh.spawn("alpha", "--model", str(real_source.path), *HALF_THE_MODEL, new_home="share-home")
    a.wait_serving(60)
    homes = {n: mesh.root / f"{n}-meshd-home" for n in ("beta", "gamma")}
    b = mesh.spawn("beta", "--model", "", *HALF_THE_MODEL, token=mesh.invite(a), env=no_index_env(homes["beta"]))
    c = mesh.spawn("gamma", "--model", "", *HALF_THE_MODEL, token=mesh.invite(a), env=no_index_env(homes["gamma"]))
    wait_until(lambda: warm_plan_over([a, b, c], 3), 240, what="a warm three-stage plan",
               explain=lambda: summary(a, b, c) + "\n" + json.dumps([sharing(p).get("fetch") for p in (b, c)]))
    for proc in (b, c):
        sh = sharing(proc)
        first, end = layers_of(a, proc.node_id())
        needed = mf.needed_tensors(manifest.tensor_names, 30, first, end)
        expected = manifest.bytes_of([*manifest.header.piece_range, *manifest.pieces_of(needed)])
        held = sh["holds"]["bytes"]
        assert not sh["holds"]["complete"] and held < manifest.size
        assert held >= expected  # its plan's range is on disk, verified ...
        assert sh["fetch"]["fetched_bytes_total"] == held  # ... and nothing was transferred twice
        assert sh["model"] == manifest.identity and sh["sha256"] == manifest.sha256
        assert_fetched_only_from_the_home(proc, homes[proc.name])
    assert sharing(a)["served"]["bytes"] > 0
    question = "What is the capital of France?"
    for proc in (a, b, c):  # any of them coordinates; every stage runs its own fetched layers
        got = MeshdClient(proc.socket, timeout=240).chat(question, max_tokens=16, temperature=0).text
        assert got == answer(question), summary(a, b, c)


def test_a_fetch_killed_halfway_resumes_where_it_stopped_and_the_cache_is_listed_and_collected(
        mesh, real_source, manifest, answer):
    a = mesh.spawn("alpha", "--model", str(real_source.path), *HALF_THE_MODEL, new_home="resume-home")
    a.wait_serving(60)
    home = mesh.root / "beta-meshd-home"
    b = mesh.spawn("beta", "--model", "", "--share-rate", "24mbit", *HALF_THE_MODEL, token=mesh.invite(a),
                   env=no_index_env(home))

    def progress():
        f = sharing(b).get("fetch") or {}
        return f.get("target") and f.get("state") == "fetching" and f.get("progress", 0) >= 0.3
    wait_until(progress, 180, what="beta's fetch a third done", explain=lambda: json.dumps(sharing(b).get("fetch")))
    kill_hard(b)  # SIGKILL: no clean shutdown, no last flush
    state = json.loads(next((b.state_dir / "models").glob("*/share-state.json")).read_text())
    assert state["have"] and not state["complete"]

    b = mesh.spawn("beta", "--model", "", *HALF_THE_MODEL, env=no_index_env(home))  # same state dir, no rate cap now
    wait_until(lambda: warm_plan_over([a, b], 2), 180, what="a warm two-stage plan after the restart",
               explain=lambda: summary(a, b) + "\n" + json.dumps(sharing(b).get("fetch")))
    sh = sharing(b)
    first, end = layers_of(a, b.node_id())
    needed = mf.needed_tensors(manifest.tensor_names, 30, first, end)
    wanted = manifest.bytes_of([*manifest.header.piece_range, *manifest.pieces_of(needed)])
    fetch = sh["fetch"]
    assert fetch["resumed_bytes"] > 0.25 * wanted, fetch  # what the killed run had recorded was kept ...
    assert fetch["fetched_bytes_total"] + fetch["resumed_bytes"] == sh["holds"]["bytes"], fetch  # ... not refetched
    assert_fetched_only_from_the_home(b, home)
    question = "Name three colours of the rainbow."
    assert MeshdClient(b.socket, timeout=240).chat(question, max_tokens=16, temperature=0).text == answer(question)

    rc, out = run_cli("model", "list", "--state-dir", str(b.state_dir), "--json")
    listed = json.loads(out)["fetched"]
    assert rc == 0 and [m["sha256"] for m in listed] == [manifest.sha256] and not listed[0]["complete"]
    assert listed[0]["held_bytes"] == sh["holds"]["bytes"] and listed[0]["disk_bytes"] < manifest.size
    rc, out = run_cli("model", "gc", "--state-dir", str(b.state_dir), "--json")
    assert rc == 0 and json.loads(out)["removed"] == [], "the running daemon's model is kept"
    b.signal(15)
    assert b.wait(60) == 0
    rc, out = run_cli("model", "gc", "--state-dir", str(b.state_dir), "--json")
    assert rc == 0 and [r["sha256"] for r in json.loads(out)["removed"]] == [manifest.sha256]
    assert not (b.state_dir / "models" / manifest.sha256).exists()
