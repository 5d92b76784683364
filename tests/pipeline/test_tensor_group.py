"""A tensor-parallel group of real processes over CurveZMQ equals the in-process group token for token
(bit for bit), and a member that dies mid-answer ends the leader's wait instead of wedging it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from decoding.quant import native
from tests.support.tensor_group import decode, run_group
from tests.support.waiting import wait_until

OK, WHY = native.available()
pytestmark = pytest.mark.skipif(not OK, reason=f"integer kernels unavailable: {WHY}")
ROOT = Path(__file__).resolve().parents[2]
# long enough that a prompt's partial sums (rows x hidden floats) exceed 64 KiB: a regression test for sums
# written into a buffer a zero-copy send was still reading
PROMPT = ("The lighthouse keeper climbed the stairs at dusk, counted the steps as his father had, and found the "
          "lamp cold. Outside, the fishing boats were coming home early, their lights low on the water, and the "
          "radio kept repeating the same warning about the storm that was due before midnight. He")


class Members:
    """``size`` member processes joined into one group; stdout lines of each as JSON."""

    def __init__(self, size: int, steps: int, logits_out: Path | None = None, exchange: str = "native"):
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MESHD_GROUP_EXCHANGE=exchange)
        self.procs = []
        for rank in range(size):
            cmd = [sys.executable, "-m", "tests.support.tensor_member", "--rank", str(rank), "--size", str(size),
                   "--steps", str(steps), "--prompt", PROMPT]
            if logits_out and rank == 0:
                cmd += ["--logits-out", str(logits_out)]
            self.procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                               env=env, cwd=ROOT))
        hello = [self.line(r) for r in range(size)]
        peers = json.dumps([{"rank": r, **h} for r, h in enumerate(hello)])
        for p in self.procs:
            p.stdin.write(peers + "\n")
            p.stdin.flush()

    def line(self, rank: int) -> dict:
        while True:
            raw = self.procs[rank].stdout.readline()
            if not raw:
                raise AssertionError(f"member {rank} ended (rc {self.procs[rank].wait()})")
            if raw.startswith("{"):
                return json.loads(raw)

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


@pytest.mark.parametrize("exchange", ["native", "python"])
def test_two_member_processes_equal_the_in_process_group_bit_for_bit(real_source, tmp_path, exchange):
    """Whether the decode kernel exchanges the partial sums itself (native) or hands each to Python."""
    whole = real_source.load_stage(0, real_source.config.num_layers, torch.float32, packed="gguf")
    prompt = torch.tensor(real_source.tokenizer.encode(PROMPT))
    assert len(prompt) * real_source.config.hidden_size * 4 > 1 << 16
    want_logits, want_tokens = run_group(whole, 2, prompt, 10)[0]
    members = Members(2, 10, tmp_path / "logits.pt", exchange)
    try:
        got = {}
        while "tokens" not in got:
            got = members.line(0)
        assert got["tokens"] == want_tokens
        # the decode steps' exchanges went the way asked (the prompt's whole blocks take the per-operation path)
        assert (got["native_exchanges"] > 0) == (exchange == "native")
        assert torch.equal(torch.load(tmp_path / "logits.pt"), want_logits)
        assert members.procs[1].wait(timeout=60) == 0  # the leader's stop reached it
        # and the group's tokens are one device's on this text
        assert decode(whole, prompt, 10)[1] == want_tokens
    finally:
        members.close()


def test_a_member_killed_mid_answer_ends_the_leaders_wait():
    members = Members(2, 4000)  # far more steps than the test waits for
    try:
        assert "step" in members.line(0)  # decoding is under way
        members.procs[1].kill()
        got = {}
        while "lost" not in got:
            got = members.line(0)
            assert "tokens" not in got
        assert "dropped its link" in got["lost"]
        wait_until(lambda: members.procs[0].poll() is not None, timeout_s=60, what="the leader to exit")
    finally:
        members.close()
