"""``meshd model list`` and ``meshd model advise``: which models there are, which this home can run.

list: both kinds of named model (the curated Hub ones and the package-index catalog),
each with its size and published Home Assistant command success, and what a pull left.
advise: a model fits when the members' budgets hold it; its decode rate is an estimate
scaled from a measured speed by weight bytes, laid on the fastest members first.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshd.model import store as model_store
from meshd.cli import main
from meshd.model.hub_models import CommandSuccess, parse_ref, pick_files, success_for, BadModelRef
from meshd.model.advice import Candidate, Member, Speed, advise

GB = 10**9


def speed(step_s=0.25, file_bytes=GB, runtime_bytes=GB):
    return Speed(step_s, file_bytes, runtime_bytes, "test")


def cand(name, gb, pct=None):
    return Candidate(name, "test", int(gb * GB), CommandSuccess(pct, name) if pct else None)


# -- the estimate ----------------------------------------------------------------------
def test_a_model_twice_the_bytes_decodes_at_half_the_measured_rate():
    [a, b] = sorted(advise([Member("a", 20 * GB, speed(0.25))], [cand("x", 1), cand("y", 2)]),
                    key=lambda a: a.candidate.name)
    assert a.tokens_per_s == pytest.approx(4.0) and b.tokens_per_s == pytest.approx(2.0)


def test_a_model_fits_only_in_the_pooled_memory_and_is_spread_fastest_member_first():
    fast, slow = Member("fast", 3 * GB, speed(0.1)), Member("slow", 3 * GB, speed(0.4))
    [alone] = advise([fast], [cand("big", 5)])
    assert not alone.fits and alone.tokens_per_s is None
    [pooled] = advise([slow, fast], [cand("big", 5)])
    # 3 GB on the fast one at 10 GB/s, 2 GB on the slow one at 2.5 GB/s: 0.3 s + 0.8 s per token
    assert pooled.fits and pooled.devices == 2 and pooled.tokens_per_s == pytest.approx(1 / 1.1)
    [small] = advise([slow, fast], [cand("small", 2)])
    assert small.devices == 1 and small.tokens_per_s == pytest.approx(5.0)  # the fast one alone


def test_loaded_size_grows_as_the_measured_model_did():
    [a] = advise([Member("m", 10 * GB, speed(0.5, file_bytes=GB, runtime_bytes=int(1.25 * GB)))], [cand("x", 2)])
    assert a.needs_bytes == int(2.5 * GB) and a.tokens_per_s == pytest.approx(1 / (2.5 / 2.5))


def test_advice_puts_what_fits_first_then_the_better_command_success():
    out = advise([Member("m", 4 * GB, speed())], [cand("fast-bad", 1, 40.0), cand("too-big", 6, 93.0),
                                                   cand("good", 3, 86.0), cand("unrated", 1)])
    assert [a.candidate.name for a in out] == ["good", "fast-bad", "unrated", "too-big"]


# -- references -----------------------------------------------------------------------
def test_references_name_a_repository_and_a_quant_or_file():
    assert str(parse_ref("qwen3:8b")) == "hf:Qwen/Qwen3-8B-GGUF:Q4_K_M"
    assert str(parse_ref("hf:a/b")) == "hf:a/b:Q4_K_M"
    assert parse_ref("hf:a/b/dir/m.gguf").file == "dir/m.gguf"
    for bad in ("hf:a", "hf:a/b/readme.md", "hf:a/b:Q4 K", "qwen9:1b"):
        with pytest.raises(BadModelRef):
            parse_ref(bad)


def test_a_quant_tag_picks_one_model_whole_and_never_a_longer_tag():
    files = ["m-Q4_K_M.gguf", "m-Q4_K.gguf", "m-Q8_0-00001-of-00002.gguf", "m-Q8_0-00002-of-00002.gguf",
             "mmproj-m-Q8_0.gguf"]
    assert pick_files(parse_ref("hf:a/b:Q4_K"), files) == ["m-Q4_K.gguf"]
    assert pick_files(parse_ref("hf:a/b:q8_0"), files) == ["m-Q8_0-00001-of-00002.gguf", "m-Q8_0-00002-of-00002.gguf"]
    with pytest.raises(BadModelRef, match="1 of the 2 parts"):
        pick_files(parse_ref("hf:a/b:Q8_0"), files[:3])
    with pytest.raises(BadModelRef, match="several models"):
        pick_files(parse_ref("hf:a/b:Q4_K_M"), ["x-Q4_K_M.gguf", "y-Q4_K_M.gguf"])


def test_published_figures_are_found_by_model_family_and_size():
    assert success_for("Qwen3-8B-Q4_K_M.gguf").percent == 93.4
    assert success_for("qwen2.5-7b-instruct-q4_k_m-00001-of-00002.gguf").percent == 88.3
    assert success_for("qwen2.5-coder-1.5b-instruct").percent == 48.0
    assert success_for("Llama-3.2-3B-Instruct-Q4_K_M.gguf").percent == 82.0
    assert success_for("qwen2.5-coder-0.5b-instruct") is None  # the 24.5 % is the plain 0.5B's


# -- the commands -----------------------------------------------------------------------
@pytest.fixture
def home(monkeypatch, tmp_path):
    monkeypatch.setenv("MESHD_HOME", str(tmp_path / "meshd"))
    monkeypatch.delenv("MESHD_SOCKET", raising=False)
    return tmp_path / "meshd"


def test_list_shows_both_kinds_with_size_source_and_command_success(home, capsys):
    assert main(["model", "list"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ") and line.split()}
    assert "93.4 %" in rows["qwen3:8b"] and "~5.0 GB" in rows["qwen3:8b"] and "Qwen/Qwen3-8B-GGUF" in rows["qwen3:8b"]
    assert "88.3 %" in rows["qwen2.5:7b"] and "86.7 %" in rows["qwen3:4b"] and "82.0 %" in rows["llama3.2:3b"]
    assert "48.0 %*" in rows["qwen2.5-coder-1.5b-instruct"] and "package index" in rows["qwen2.5-coder-1.5b-instruct"]
    assert "home-assistant-datasets" in out


def test_list_shows_what_a_hub_pull_left_with_its_real_size(home, capsys):
    d = home / "models" / "hub" / "Qwen--Qwen3-4B-GGUF"
    d.mkdir(parents=True)
    (d / "Qwen3-4B-Q4_K_M.gguf").write_bytes(b"GGUF" + bytes(1000))
    assert main(["model", "list", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    [hub] = doc["hub"]
    assert hub["name"] == "hf:Qwen/Qwen3-4B-GGUF/Qwen3-4B-Q4_K_M.gguf" and hub["size_bytes"] == 1004
    assert hub["command_success"]["percent"] == 86.7
    row = next(r for r in doc["by_name"] if r["name"] == "qwen3:4b")
    assert row["pulled"] and row["exact_size"] and row["size_bytes"] == 1004
    assert model_store.resolve_model("qwen3:4b") == d / "Qwen3-4B-Q4_K_M.gguf"


def test_advise_on_this_device_alone_uses_the_shipped_profile_and_says_so(home, capsys):
    assert main(["model", "advise", "--memory", "3GiB"]) == 0
    out = capsys.readouterr().out
    assert "--memory 3GiB" in out and "shipped profile" in out and "an estimate" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("  ")}
    assert rows["qwen3:8b"][3] == "no" and rows["qwen3:4b"][3] == "yes"


def test_advise_uses_this_devices_own_profile_and_scales_its_speed(home, capsys):
    shipped = Path(model_store.__file__).parent.parent / "profiles" / "x86_64-2core-1thread-packed-qwen2.5-coder-1.5b.json"
    (home / "profiles").mkdir(parents=True)
    data = json.loads(shipped.read_text())
    data["decode_step_s"] = [s / 4 for s in data["decode_step_s"]]  # a device four times as fast
    (home / "profiles" / "self.json").write_text(json.dumps(data))
    assert main(["model", "advise", "--memory", "64GB", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["speed"]["source"].startswith("this device's profile")
    rate = {m["name"]: m["tokens_per_s_estimate"] for m in doc["models"]}
    assert rate["qwen2.5-coder-1.5b-instruct"] == pytest.approx(4 / 0.2357, rel=0.02)
    assert rate["qwen3:8b"] == pytest.approx(rate["qwen2.5-coder-1.5b-instruct"] * 1_117_320_768 / 5_030_000_000,
                                             rel=0.02)
    assert all(m["fits"] for m in doc["models"])


def test_a_hint_to_run_the_homes_model_names_the_hub_model_it_was_pulled_as(home):
    d = home / "models" / "hub" / "Qwen--Qwen3-8B-GGUF"
    d.mkdir(parents=True)
    (d / "Qwen3-8B-Q4_K_M.gguf").write_bytes(b"GGUF")
    other = home / "models" / "hub" / "acme--x-GGUF" / "q8"
    other.mkdir(parents=True)
    (other / "x-Q8_0.gguf").write_bytes(b"GGUF")
    assert model_store.model_flag_for("Qwen3-8B-Q4_K_M.gguf@0123456789abcdef") == "with --model qwen3:8b"
    assert model_store.model_flag_for("x-Q8_0.gguf@0123456789abcdef") == "with --model hf:acme/x-GGUF/q8/x-Q8_0.gguf"
    assert model_store.model_flag_for("y.gguf@0123") == "with --model set to a copy of y.gguf"


class _StatusHandler(__import__("http.server").server.BaseHTTPRequestHandler):
    """A daemon's status endpoint on a unix socket: the members a running home reports."""

    protocol_version = "HTTP/1.1"
    members: list = []

    def log_message(self, *args):
        pass

    def do_GET(self):
        body = json.dumps({"members": self.members}).encode() if self.path == "/v1/mesh/status" else b"{}"
        self.send_response(200 if self.path == "/v1/mesh/status" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_advise_pools_the_memory_of_the_members_a_running_daemon_reports(home, tmp_path, capsys):
    import socketserver
    import threading

    _StatusHandler.members = [
        {"name": "pi", "state": "ready", "memory_budget": 3000},
        {"name": "laptop", "state": "ready", "memory_budget": 4000},
        {"name": "gone", "state": "offline", "memory_budget": 8000},  # not counted: it is not there
    ]
    sock = tmp_path / "d.sock"
    server = socketserver.ThreadingUnixStreamServer(str(sock), _StatusHandler)
    server.daemon_threads, server.block_on_close = True, False  # a kept-alive connection never blocks the close
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert main(["model", "advise", "--socket", str(sock), "--json"]) == 0
    finally:
        server.shutdown()
        server.server_close()
    doc = json.loads(capsys.readouterr().out)
    assert doc["members_from"] == "the running daemon's members"
    assert [m["name"] for m in doc["members"]] == ["pi", "laptop"] and doc["pooled_bytes"] == 7000 << 20
    fits = {m["name"]: (m["fits"], m["devices"]) for m in doc["models"]}
    assert fits["qwen3:8b"] == (True, 2)  # 6.1 GB: neither alone, both together
    assert fits["qwen3:4b"] == (True, 1)


def test_advise_with_a_socket_nobody_answers_on_says_so(home, tmp_path, capsys):
    assert main(["model", "advise", "--socket", str(tmp_path / "nobody.sock")]) == 1
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
