"""``meshd heads``: the train and eval commands end to end on the embedded model (tiny settings)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from decoding.medusa import MedusaHeads
from decoding.training.medusa_data import is_heldout


def meshd(*args, timeout=240):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "meshd", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.fixture()
def two_prompts(tmp_path):
    """One held-out and one training prompt (ids picked by the deterministic split)."""
    held = next(f"t-{i}" for i in range(1000) if is_heldout(f"t-{i}"))
    train = next(f"t-{i}" for i in range(1000) if not is_heldout(f"t-{i}"))
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in [
        {"id": held, "category": "home", "prompt": "How do I turn off the hallway light?"},
        {"id": train, "category": "home", "prompt": "What does a door sensor do?"},
    ]) + "\n")
    return path


@pytest.mark.slow
def test_heads_eval_json_reports_per_head_accuracy_of_the_shipped_heads():
    res = meshd("heads", "eval", "--json", "--limit", "1", "--max-new-tokens", "12", "--generator", "runtime")
    assert res.returncode == 0, res.stderr
    out = last_json(res.stdout)
    assert out["heads"].endswith("medusa-smollm2-135m.pt")
    assert len(out["top1"]) == len(out["top5"]) == 5
    assert all(0.0 <= a <= b <= 1.0 for a, b in zip(out["top1"], out["top5"]))
    assert out["runtime_check"]["answers"] == 1
    assert out["chain"]["rounds"] >= 1 and out["shipped_tree"]["nodes"] >= 5


@pytest.mark.slow
def test_heads_train_writes_a_loadable_file_and_prints_json(tmp_path, two_prompts):
    out_file = tmp_path / "heads.pt"
    res = meshd("heads", "train", "--json", "--prompts", str(two_prompts), "--max-new-tokens", "10",
                "--generator", "runtime", "--steps", "3", "--batch-size", "8", "--heads", "3",
                "--out", str(out_file))
    assert res.returncode == 0, res.stderr
    out = last_json(res.stdout)
    heads = MedusaHeads.load(out_file, sha256=out["sha256"], vocab_size=49152, hidden_size=576)
    assert heads.num_heads == 3
    assert heads.meta["training"]["steps"] == 3
    assert heads.meta["training"]["train_prompts"] == 1 and heads.meta["training"]["heldout_prompts"] == 1
    assert heads.meta["model"]["identity"].startswith("SmolLM2-135M-Instruct")
    assert "train" in res.stderr  # the progress bar


def test_heads_eval_with_a_missing_file_is_one_clear_error_line(tmp_path):
    res = meshd("heads", "eval", "--heads", str(tmp_path / "missing.pt"), timeout=60)
    assert res.returncode == 1
    assert "meshd: error:" in res.stderr and "not found" in res.stderr
    assert "Traceback" not in res.stderr
