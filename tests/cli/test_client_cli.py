"""``meshd status`` and ``meshd chat`` against a served fake engine."""

from __future__ import annotations

import json

import pytest

from meshd.cli import main
from meshd.commands.chat import summary_line
from meshd.commands.status import render_status
from tests.support.api import REPLY


@pytest.fixture(autouse=True)
def keep_logging_config(monkeypatch):
    """``main()`` would point logging at capsys' stream, which closes after the test."""
    import meshd.log

    monkeypatch.setattr(meshd.log, "configure", lambda *a, **k: None)


def test_status_json_prints_the_daemon_status(server, capsys):
    assert main(["status", "--socket", str(server.socket_path), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["home"]["name"] == "smith-home" and s["model"] == "fake-model"
    assert s["plan"]["version"] == 3


def test_status_table_has_one_row_per_device_then_plan_and_performance(server, capsys):
    assert main(["status", "--socket", str(server.socket_path)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("NAME"))
    assert lines[header].split() == ["NAME", "STATE", "ADDRESS", "MEMORY", "LAYERS", "KV", "TOKENS",
                                     "UPTIME", "VERSION", "MODEL", "LAST", "SEEN", "RTT"]
    assert lines[header + 1].split()[:7] == ["desk-pc", "*", "active", "192.168.1.10:7400", "6.0", "GiB", "[0,18)"]
    assert lines[header + 2].split()[:6] == ["kitchen-pi", "joining", "192.168.1.20:7400", "1.5", "GiB", "[18,30)"]
    assert "3s ago" in lines[header + 2]
    assert lines[0] == "meshd - home smith-home, this node desk-pc (n-abc123), serving"
    assert "plan v3, 2 stages, predicted bottleneck: 0.04 s, leader n-abc123" in out
    assert "recent:" in out and "0 in flight" in out
    assert "advertising on: eth0 (192.168.1.10)" in out
    assert "neighbour-nas" in out and "another home" in out


def test_status_without_a_daemon_says_so_and_exits_1(short_tmp, capsys):
    path = short_tmp / "meshd.sock"
    assert main(["status", "--socket", str(path)]) == 1
    err = capsys.readouterr().err
    assert "no meshd daemon is running" in err and str(path) in err


def test_status_uses_the_shared_default_socket_path(server, capsys, monkeypatch):
    monkeypatch.setenv("MESHD_SOCKET", str(server.socket_path))
    assert main(["status", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["node_id"] == "n-abc123"


def test_status_watch_refreshes_until_interrupted(server, capsys, monkeypatch):
    import meshd.commands.status as status_cmd

    sleeps = []

    def fake_sleep(s):
        sleeps.append(s)
        if len(sleeps) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(status_cmd.time, "sleep", fake_sleep)
    assert main(["status", "--socket", str(server.socket_path), "--watch", "0.5"]) == 0
    assert capsys.readouterr().out.count("kitchen-pi") == 2  # one table row, twice
    assert sleeps == [0.5, 0.5]


@pytest.mark.parametrize("status", [
    {},
    {"members": None, "plan": None, "recent": None},
    {"members": [{}], "not_admitted": [{}], "interfaces": ["wlan0"], "plan": "pending"},
    {"members": [{"name": "x", "layers": [[0, 4], [8, 12]], "memory_budget": "2G",
                  "last_seen_s": 9000}], "plan": {"stages": 2, "predicted_bottleneck": {"x": 1}}},
])
def test_status_renders_whatever_keys_are_missing_or_odd(status):
    text = render_status(status)
    assert text.startswith("meshd")
    assert "plan" in text


def test_render_handles_partial_members():
    text = render_status({"members": [{"name": "x", "layers": [[0, 4], [8, 12]]}]})
    assert "[0,4),[8,12)" in text


def test_chat_streams_the_answer_to_stdout_and_a_summary_to_stderr(server, capsys, engine):
    rc = main(["chat", "--socket", str(server.socket_path), "--max-tokens", "20",
               "--temperature", "0", "Why", "is", "the", "sky", "blue?"])
    assert rc == 0
    out, err = capsys.readouterr()
    assert out == REPLY[:20] + "\n"
    summary = err.strip().splitlines()[-1]  # (the server thread may log to the same stderr)
    assert summary.startswith("[20 tokens in") and "finish: length" in summary
    assert engine.requests[-1].messages == [{"role": "user", "content": "Why is the sky blue?"}]


def test_chat_without_a_daemon_says_so(short_tmp, capsys):
    assert main(["chat", "--socket", str(short_tmp / "x.sock"), "hi"]) == 1
    assert "no meshd daemon is running" in capsys.readouterr().err


def test_summary_line_reports_ttft_and_decode_speed():
    line = summary_line({"completion_tokens": 11}, 3.0, 1.0, "stop")
    assert line == "[11 tokens in 3.00 s: TTFT 1.00 s, 5.0 tokens/s; finish: stop]"


def test_status_names_the_bottlenecks_unit_and_tells_same_named_devices_apart():
    text = render_status({
        "version": "0.1.0", "uptime_s": 7300,
        "members": [{"node_id": "n-1", "name": "pi", "self": True, "kv_tokens": 512, "uptime_s": 90,
                     "version": "0.1.0", "model_digest": "b179c9523d0e6a0f"},
                    {"node_id": "n-2", "name": "pi", "last_error": "model load failed: no space"}],
        "plan": {"version": 2, "predicted_bottleneck": 1.25, "predicted_bottleneck_for_tokens": 512,
                 "weights": "packed"}})
    assert "meshd 0.1.0, up 2.0h" in text.splitlines()[0]
    assert "pi (n-1) *" in text and "pi (n-2)" in text
    assert "512" in text and "b179c9523d0e6a0f" in text and "90s" in text
    assert "last error on pi (n-2): model load failed: no space" in text
    assert "predicted bottleneck: 1.25 s per 512-token prompt" in text
    assert "numeric mode packed" in text


def test_status_shows_each_members_link_round_trip_or_that_it_stopped_answering():
    text = render_status({
        "members": [{"node_id": "n-1", "name": "desk", "self": True},
                    {"node_id": "n-2", "name": "pi"}, {"node_id": "n-3", "name": "nas"},
                    {"node_id": "n-4", "name": "laptop"}, {"node_id": "n-5", "name": "tv"}],
        "links": {"n-2": {"rtt_s": 0.00042, "reachable": True, "failures": 0, "age_s": 1.0},
                  "n-3": {"rtt_s": None, "reachable": False, "failures": 3, "age_s": 30.0},
                  "n-4": {"rtt_s": None, "reachable": False, "failures": 0, "age_s": None}}})
    rows = {line.split()[0]: line for line in text.splitlines() if line.split()[:1] in
            (["desk"], ["pi"], ["nas"], ["laptop"], ["tv"])}
    assert rows["pi"].endswith("0.4 ms")
    assert rows["nas"].endswith("unreachable")
    assert rows["laptop"].endswith("-")  # its first probe is still out
    assert rows["desk"].endswith("-") and rows["tv"].endswith("-")


def test_status_says_what_each_device_is_planned_with():
    text = render_status({"profile": "shipped default: self-profiling is off (self_profile = off)", "members": [
        {"name": "laptop", "self": True, "profile": "1.90x x86_64-2core-1thread (one-layer estimate)"},
        {"name": "nas", "profile": "shipped default"}]})
    assert ("planned with profiles: laptop: 1.90x x86_64-2core-1thread (one-layer estimate); "
            "nas: shipped default") in text
    assert "this device's profile: shipped default: self-profiling is off" in text


@pytest.mark.parametrize("argv, usage", [
    (["join", "--prot", "0"], "usage: meshd join"),
    (["model", "pull", "--bogus"], "usage: meshd model pull"),
    (["status", "--json", "--bogus"], "usage: meshd status"),
])
def test_a_wrong_flag_gets_the_subcommands_usage_not_the_top_level_one(argv, usage, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert usage in err and f"unrecognized arguments: {argv[-1] if argv[-1] != '0' else '--prot 0'}" in err


def test_daemons_that_share_one_machine_are_named_so_their_memory_is_not_read_as_twice_the_ram():
    gib = 6 * 2**30
    text = render_status({"members": [
        {"name": "a", "address": "127.0.0.1:40001", "memory_budget_bytes": gib, "self": True},
        {"name": "b", "address": "127.0.0.1:40002", "memory_budget_bytes": gib},
        {"name": "nas", "address": "192.168.1.9:7410", "memory_budget_bytes": gib}]})
    [note] = [line for line in text.splitlines() if line.startswith("one machine:")]
    assert "a *" not in note and "a, b run on 127.0.0.1" in note and "nas" not in note
