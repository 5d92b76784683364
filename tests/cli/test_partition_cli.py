"""``meshd plan`` and ``meshd profile`` from the command line."""

import json

import pytest

from meshd.cli import main
from partition import profile as pf
from partition.plan import Plan
from partition.synthetic import small_model, synthetic_profile


@pytest.fixture
def profiles(tmp_path):
    a = pf.save(synthetic_profile("laptop", speed=1.0), tmp_path / "laptop.json")
    b = pf.save(synthetic_profile("desktop", speed=2.5), tmp_path / "desktop.json")
    return a, b


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_plan_prints_stages_bottleneck_and_a_json_summary(profiles, capsys):
    a, b = profiles
    assert main(["plan", "--profile", str(a), "--profile", str(b), "--link", "1gbit,1ms",
                 "--json"]) == 0
    out = capsys.readouterr().out
    assert "bottleneck" in out and "laptop" in out and "desktop" in out
    summary = last_json(out)
    assert summary["planning_seconds"] > 0
    stages = summary["stages"]
    assert stages[0]["first_layer"] == 0 and stages[-1]["end_layer"] == 30  # half-open
    assert stages[0]["has_embedding"] and stages[-1]["has_head"]
    assert {s["device"] for s in stages} == {"laptop", "desktop"}
    assert "cuts" not in summary


def test_plan_with_prompt_length_gives_cuts_and_predicted_ttft(profiles, capsys):
    a, b = profiles
    assert main(["plan", "--profile", str(a), "--profile", str(b), "--max-seq", "1024",
                 "--prompt-len", "900", "--json"]) == 0
    summary = last_json(capsys.readouterr().out)
    cuts = summary["cuts"]
    assert cuts == sorted(cuts) and all(0 < c < 900 for c in cuts)
    assert sum(summary["chunks"]) == 900
    assert 0 < summary["predicted_ttft_s"] < summary["unchunked_prefill_s"]


def plan_two(tmp_path) -> list[str]:
    """``meshd plan`` over two synthetic devices a and b, a 512-token prompt, JSON last."""
    a = pf.save(synthetic_profile("a"), tmp_path / "a.json")
    b = pf.save(synthetic_profile("b"), tmp_path / "b.json")
    return ["plan", "--profile", str(a), "--profile", str(b), "--prompt-len", "512", "--json"]


def test_plan_prices_layouts_for_a_workload_and_says_which_and_why(tmp_path, capsys):
    args = plan_two(tmp_path)
    assert main([*args, "--in-flight", "4", "--cached", "0.9"]) == 0
    out = capsys.readouterr().out
    busy = last_json(out)["layout"]
    assert busy["kind"] == "replicas" and busy["routes"] == [[["a", 0, 30]], [["b", 0, 30]]]
    assert "layout replicas" in out and "each holds the whole model" in out
    assert main([*args, "--layout", "pipeline"]) == 0
    forced = last_json(capsys.readouterr().out)["layout"]
    assert forced["kind"] == "pipeline" and "forced to pipeline" in forced["reason"]


def test_plan_prices_a_tensor_group_and_names_its_members(tmp_path, capsys):
    assert main([*plan_two(tmp_path), "--layout", "tensor", "--link", "1gbit,0.1ms"]) == 0
    out = capsys.readouterr().out
    forced = last_json(out)["layout"]
    assert forced["kind"] == "tensor" and forced["tensor_groups"] == [["a", "b"]]
    assert "layout tensor: a+b [0,30)" in out and "tensor group over a, b" in out


def test_status_names_a_plan_of_several_routes_by_its_layout():
    from meshd.commands.status_render import render_status

    text = render_status({"plan": {"version": 4, "layout": "replicas", "reason": "2 replica(s) (a, b)",
                                   "stages": [{"node_id": "a", "layers": [0, 30], "route": 0},
                                              {"node_id": "b", "layers": [0, 30], "route": 1}]}})
    assert "layout replicas (2 routes)" in text and "2 replica(s)" in text


def test_plan_scales_unmeasured_devices_and_names_identical_ones_apart(profiles, capsys):
    a, _ = profiles
    assert main(["plan", "--profile", str(a), "--profile", str(a),
                 "--profile", f"{a}@speed=0.5,mem=1GiB,id=tablet", "--link", "local",
                 "--json"]) == 0
    devices = {s["device"] for s in last_json(capsys.readouterr().out)["stages"]}
    assert devices == {"laptop", "laptop#2", "tablet"}


def test_plan_writes_the_broadcast_form_with_its_cut_table(profiles, tmp_path, capsys):
    a, b = profiles
    out = tmp_path / "plan.json"
    assert main(["plan", "--profile", str(a), "--profile", str(b), "--max-seq", "256",
                 "--out", str(out)]) == 0
    plan = Plan.from_json(out.read_text())
    assert plan.cut_table.max_seq == 256 and len(plan.stages) >= 1


def test_plan_errors_are_one_line(tmp_path, profiles, capsys):
    a, _ = profiles
    other = pf.save(synthetic_profile("x", model=small_model(30, "other-model")), tmp_path / "x.json")
    assert main(["plan", "--profile", str(a), "--profile", str(other)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshd: error:") and "different models" in err and "\n" not in err
    tiny = pf.save(synthetic_profile("tiny", memory_bytes=100 * 2**20), tmp_path / "tiny.json")
    assert main(["plan", "--profile", str(tiny)]) == 1
    assert "short by" in capsys.readouterr().err
    assert main(["plan", "--profile", str(a), "--prompt-len", "5000"]) == 1
    assert main(["plan", "--profile", str(a), "--link", "fast"]) == 1


def test_profile_scale_from_writes_a_profile_for_an_unmeasured_device(profiles, tmp_path, capsys):
    a, _ = profiles
    out = tmp_path / "phone.json"
    assert main(["profile", "--scale-from", str(a), "--speed", "0.3", "--memory", "3GiB",
                 "--device-id", "phone", "-o", str(out), "--json"]) == 0
    phone = pf.load(out)
    assert phone.device_id == "phone" and phone.scaled_from["speed_factor"] == 0.3
    assert main(["profile", "--scale-from", str(a)]) == 1  # needs --speed


@pytest.mark.slow
def test_profiler_measures_a_model_and_reuses_a_matching_profile(tiny_llama, tmp_path, capsys):
    path, _ = tiny_llama
    out = tmp_path / "dev.json"
    args = ["profile", "--model", str(path), "--max-seq", "64", "--repeats", "1",
            "--device-id", "dev", "-o", str(out), "--no-progress", "--json"]
    assert main(args) == 0
    first = last_json(capsys.readouterr().out)
    assert first["reused"] is False
    prof = pf.load(out)
    L = prof.num_layers
    assert len(prof.layer_latency_s) == L + 2 and prof.threads == 1 and prof.dtype == "float32"
    assert prof.q.x[-1] == 64 and prof.q.y[-1] == 64
    assert prof.kv_bytes_per_token_per_layer == 2 * prof.model.num_kv_heads * prof.model.head_dim * 4
    assert all(w > 0 for w in prof.weight_bytes)
    assert prof.q_error["points"] and prof.min_chunk >= 1
    assert prof.memory_budget_bytes > 0 and prof.measured_at
    # the same settings again: re-used, not re-measured
    assert main(args) == 0
    assert last_json(capsys.readouterr().out)["reused"] is True
    assert main(args + ["--force"]) == 0
    assert last_json(capsys.readouterr().out)["reused"] is False
    # different settings: measured again
    assert main(args[:-2] + ["--repeats", "2", "--no-progress", "--json"]) == 0
    assert last_json(capsys.readouterr().out)["reused"] is False
    # a quick estimate against that profile: one layer timed, the reference scaled
    quick = tmp_path / "quick.json"
    assert main(["profile", "--model", str(path), "--quick-from", str(out), "--device-id", "q",
                 "-o", str(quick), "--json"]) == 0
    q = pf.load(quick)
    assert q.device_id == "q" and 0.1 < q.scaled_from["speed_factor"] < 10


def test_profile_install_copies_into_the_daemon_state_dir(profiles, tmp_path, capsys):
    a, _ = profiles
    state = tmp_path / "state"
    assert main(["profile", "--scale-from", str(a), "--speed", "1.2", "--device-id", "me",
                 "-o", str(tmp_path / "me.json"), "--install", "--state-dir", str(state)]) == 0
    assert pf.load(state / "profiles" / "me.json").device_id == "me"


def test_status_names_a_tensor_groups_members():
    from meshd.commands.status_render import render_status

    text = render_status({"plan": {"version": 5, "layout": "tensor", "reason": "a tensor group over a, b",
                                   "stages": [{"node_id": "a", "layers": [0, 28], "tensor_group": ["a", "b"]}]}})
    assert "tensor group a+b holds layers [0, 28]" in text
