"""``meshd model pull hf:…`` against a stand-in Hub on 127.0.0.1 (``HF_ENDPOINT``).

What a user relies on: the file named by a quant tag, a file name or a curated name is
fetched from the commit the Hub reports, checked against the Hub's sha256 and kept where
``--model`` finds it without the Hub; a dropped connection resumes where it stopped, and
so does a pull run again after one that failed; a file whose hash is wrong is never kept;
a missing repository or an unreachable Hub is one line and exit 1; nothing but the Hub
(here: the stand-in) is contacted.
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys

import pytest

from decoding.loader import open_model
from meshd.model import store as model_store
from meshd.cli import main
from tests.support.gguf import write_tiny_gguf
from tests.support.gguf_split import split_gguf
from tests.support.hub_standin import COMMIT, HubStandIn, connections
from tests.support.repo import ROOT


@pytest.fixture
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("hub-src")
    single = write_tiny_gguf(d / "tiny.gguf", layers=3, seed=1)
    other = write_tiny_gguf(d / "other.gguf", layers=2, seed=2)
    (d / "split").mkdir()
    parts = split_gguf(single, d / "split" / "tiny.gguf", parts=3)
    return {"single": single.read_bytes(), "other": other.read_bytes(),
            "parts": [p.read_bytes() for p in parts]}


@pytest.fixture
def hub(monkeypatch, tmp_path, tiny):
    monkeypatch.setenv("MESHD_HOME", str(tmp_path / "meshd"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with HubStandIn() as stand_in:
        stand_in.add("acme/tiny-GGUF", {"tiny-Q4_K_M.gguf": tiny["single"], "tiny-Q8_0.gguf": tiny["other"],
                                         "README.md": b"# tiny\n"})
        stand_in.add("acme/split-GGUF", {f"q4_k_m/tiny-q4_k_m-0000{i}-of-00003.gguf": b
                                          for i, b in enumerate(tiny["parts"], 1)})
        stand_in.add("Qwen/Qwen3-4B-GGUF", {"Qwen3-4B-Q4_K_M.gguf": tiny["single"],
                                             "Qwen3-4B-Q8_0.gguf": tiny["other"]})
        monkeypatch.setenv("HF_ENDPOINT", stand_in.endpoint)
        yield stand_in


def pull(*args):
    with connections() as seen:
        rc = main(["model", "pull", *args])
    return rc, seen


def only_the_stand_in(seen, hub):
    assert seen, "the pull made no connection at all"
    assert {tuple(a[:2]) for a in seen} == {("127.0.0.1", hub.port)}, seen


def test_a_quant_tag_pulls_that_file_from_the_reported_commit_and_model_finds_it(hub, tiny, capsys):
    rc, seen = pull("hf:acme/tiny-GGUF:Q4_K_M")
    assert rc == 0
    only_the_stand_in(seen, hub)
    path = model_store.resolve_model("hf:acme/tiny-GGUF:Q4_K_M")
    assert path.name == "tiny-Q4_K_M.gguf" and path.read_bytes() == tiny["single"]
    assert f"pulled: {path}" in capsys.readouterr().out
    assert [r.path for r in hub.gets("tiny-Q4_K_M.gguf")] == [f"/acme/tiny-GGUF/resolve/{COMMIT}/tiny-Q4_K_M.gguf"]
    assert not hub.gets("tiny-Q8_0.gguf") and not hub.gets("README.md")
    assert not list(path.parent.glob("*.incomplete"))


def test_the_default_quant_is_q4_k_m_and_a_file_can_be_named(hub, tiny):
    assert pull("hf:acme/tiny-GGUF")[0] == 0
    assert model_store.resolve_model("hf:acme/tiny-GGUF").read_bytes() == tiny["single"]
    assert pull("hf:acme/tiny-GGUF/tiny-Q8_0.gguf")[0] == 0
    assert model_store.resolve_model("hf:acme/tiny-GGUF/tiny-Q8_0.gguf").read_bytes() == tiny["other"]


def test_a_curated_name_pulls_its_official_repositorys_q4_k_m_file(hub, tiny):
    rc, seen = pull("qwen3:4b")
    assert rc == 0
    only_the_stand_in(seen, hub)
    assert hub.gets("Qwen3-4B-Q4_K_M.gguf") and not hub.gets("Qwen3-4B-Q8_0.gguf")
    assert model_store.resolve_model("qwen3:4b").read_bytes() == tiny["single"]


def test_a_split_set_pulls_every_part_and_loads_as_the_single_file(hub, tiny):
    rc, seen = pull("hf:acme/split-GGUF:Q4_K_M")
    assert rc == 0
    only_the_stand_in(seen, hub)
    asked = len(hub.requests)
    with connections() as seen:  # what a daemon does at start: resolve and open, offline
        first = model_store.resolve_model("hf:acme/split-GGUF:Q4_K_M")
        src = open_model(first)
    assert not seen and len(hub.requests) == asked
    assert first.name == "tiny-q4_k_m-00001-of-00003.gguf"
    assert [p.read_bytes() for p in src.parts] == tiny["parts"]
    assert src.config.num_layers == 3


def test_a_second_pull_downloads_nothing(hub, capsys):
    assert pull("hf:acme/tiny-GGUF:Q4_K_M")[0] == 0
    assert pull("hf:acme/tiny-GGUF:Q4_K_M")[0] == 0
    assert len(hub.gets("tiny-Q4_K_M.gguf")) == 1
    assert "already cached" in capsys.readouterr().out


def test_a_connection_dropped_mid_file_resumes_with_a_range_request(hub):
    """huggingface_hub writes what it received in 10 MiB chunks: the file is large enough that
    the connection drops after some were written, and the retry asks for the rest only."""
    big = os.urandom(24 << 20)
    hub.add("acme/big-GGUF", {"big-Q4_K_M.gguf": big})
    hub.drop_after["big-Q4_K_M.gguf"] = 16 << 20
    rc, seen = pull("hf:acme/big-GGUF", "--quiet")
    assert rc == 0
    only_the_stand_in(seen, hub)
    first, again = hub.gets("big-Q4_K_M.gguf")
    assert first.range is None and again.range is not None
    resumed_at = int(again.range.removeprefix("bytes=").removesuffix("-"))
    assert 0 < resumed_at <= 16 << 20, again.range
    assert model_store.resolve_model("hf:acme/big-GGUF").read_bytes() == big


def test_a_pull_run_again_after_a_failed_one_resumes_its_partial_file(hub, tiny, tmp_path):
    kept = len(tiny["single"]) // 3
    d = tmp_path / "meshd" / "models" / "hub" / "acme--tiny-GGUF"
    d.mkdir(parents=True)
    (d / "tiny-Q4_K_M.gguf.incomplete").write_bytes(tiny["single"][:kept])  # what an interrupted pull left
    assert pull("hf:acme/tiny-GGUF:Q4_K_M")[0] == 0
    assert [g.range for g in hub.gets("tiny-Q4_K_M.gguf")] == [f"bytes={kept}-"]
    assert (d / "tiny-Q4_K_M.gguf").read_bytes() == tiny["single"]


def test_a_file_that_fails_its_sha256_is_refused_and_not_kept(hub, tmp_path, capsys):
    hub.corrupt.add("tiny-Q4_K_M.gguf")
    rc, _ = pull("hf:acme/tiny-GGUF:Q4_K_M")
    err = capsys.readouterr().err.strip()
    assert rc == 1 and len(err.splitlines()) == 1 and "sha256" in err and "deleted" in err
    d = tmp_path / "meshd" / "models" / "hub" / "acme--tiny-GGUF"
    assert not list(d.glob("*.gguf*")), "neither the bad file nor its partial copy stays"
    with pytest.raises(model_store.ModelNotAvailable, match="meshd model pull"):
        model_store.resolve_model("hf:acme/tiny-GGUF:Q4_K_M")


def test_hf_token_is_sent_to_the_hub(hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    assert pull("hf:acme/tiny-GGUF:Q4_K_M")[0] == 0
    assert {r.authorization for r in hub.requests} == {"Bearer hf_test_token"}


def test_a_quant_tag_no_file_has_lists_what_there_is(hub, capsys):
    rc, _ = pull("hf:acme/tiny-GGUF:Q5_K_S")
    err = capsys.readouterr().err.strip()
    assert rc == 1 and len(err.splitlines()) == 1 and "tiny-Q4_K_M.gguf, tiny-Q8_0.gguf" in err


def _cli(env_extra: dict, *args) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MESHD_", "HF_"))} | env_extra
    return subprocess.run([sys.executable, "-m", "meshd", "model", "pull", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_missing_repository_is_one_line_and_exit_1(hub, tmp_path):
    done = _cli({"HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1",
                 "MESHD_HOME": str(tmp_path / "m")}, "hf:acme/no-such-GGUF")
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines() == [
        "meshd: error: hf:acme/no-such-GGUF:Q4_K_M: no repository acme/no-such-GGUF on "
        f"{hub.endpoint} (private ones need HF_TOKEN)"]
    assert [r.path for r in hub.requests] == ["/api/models/acme/no-such-GGUF"]


def test_a_hub_that_cannot_be_reached_is_one_line_and_exit_1(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]  # closed again below: nothing listens there
    done = _cli({"HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HOME": str(tmp_path / "hf"),
                 "HF_HUB_DISABLE_TELEMETRY": "1", "MESHD_HOME": str(tmp_path / "m")}, "qwen3:8b")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert lines[0].startswith(f"meshd: error: hf:Qwen/Qwen3-8B-GGUF:Q4_K_M: cannot reach http://127.0.0.1:{port}")


def test_the_pulled_bytes_are_what_the_hub_hashed(hub, tiny):
    assert pull("hf:acme/tiny-GGUF:Q4_K_M")[0] == 0
    got = model_store.resolve_model("hf:acme/tiny-GGUF:Q4_K_M").read_bytes()
    assert hashlib.sha256(got).hexdigest() == hashlib.sha256(tiny["single"]).hexdigest()


def test_a_second_pull_of_the_same_file_at_once_is_refused_not_interleaved(hub, tmp_path, capsys):
    import fcntl

    d = tmp_path / "meshd" / "models" / "hub" / "acme--tiny-GGUF"
    d.mkdir(parents=True)
    with open(d / "tiny-Q4_K_M.gguf.incomplete", "ab") as busy:
        fcntl.flock(busy, fcntl.LOCK_EX)  # as a pull running in another process holds it
        rc, _ = pull("hf:acme/tiny-GGUF:Q4_K_M")
    assert rc == 1 and "another pull of tiny-Q4_K_M.gguf is running" in capsys.readouterr().err
    assert not hub.gets("tiny-Q4_K_M.gguf")
