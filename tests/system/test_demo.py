"""The quick-start main job: a real 2-daemon mesh answers, each device serving part of the layers."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_demo_runs_two_daemons_that_split_the_model_and_stop_cleanly(real_source):
    res = subprocess.run([sys.executable, "-m", "meshd", "demo", "--json", "--max-tokens", "24"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert sorted(d["device"] for d in out["devices"]) == ["demo-a", "demo-b"]  # stage order: planner's
    (a0, a1), (b0, b1) = (d["layers"] for d in out["devices"])
    assert a0 == 0 and a1 == b0 and b1 == real_source.config.num_layers
    assert out["text"].strip() and out["ttft_s"] > 0 and out["tokens_per_s"] > 0
