"""What `meshd status` says about model sharing: what this device holds, how its fetch goes, whom a plan waits for."""

from meshd.commands.status import render_status


def test_status_shows_holdings_fetch_progress_waiting_members_and_shunned_peers():
    s = {
        "name": "kitchen", "node_id": "aa", "members": [{"node_id": "aa", "name": "kitchen", "self": True},
                                                        {"node_id": "bb", "name": "jetson"}],
        "sharing": {
            "holds": {"complete": False, "layers": [[10, 20]], "tensors": ["token_embd.weight"], "fraction": 0.31},
            "fetch": {"state": "fetching", "target": [10, 20], "progress": 0.45, "done_bytes": 10_800_000,
                      "wanted_bytes": 24_000_000, "rate_mbit": 95.2, "eta_s": 1.2},
            "served": {"pieces": 3, "bytes": 3_000_000},
            "plan_waits_for": {"bb": [20, 30]},
            "peers": {"bb": {"fetch": {"state": "fetching", "target": [20, 30], "progress": 0.5,
                                       "done_bytes": 1 << 20, "wanted_bytes": 2 << 20}}},
            "banned": {"cc": "sent piece 7 (blk.3.ffn_up.weight) that failed its sha256"},
        },
    }
    text = render_status(s)
    assert "model sharing: holds layers [10,20) + token_embd.weight (31% of the file); fetching layers [10,20): 45%" in text
    assert "95.2 Mbit/s, 1.2 s left" in text and "lent 2.9 MiB to others" in text
    assert "plan waits for jetson (layers [20,30)): fetching layers [20,30): 50% (1.0 MiB / 2.0 MiB)" in text
    assert "not asking cc for pieces: sent piece 7" in text


def test_a_device_holding_the_whole_file_and_an_old_daemon_without_sharing():
    assert "model sharing: holds the whole file; idle" in render_status(
        {"sharing": {"holds": {"complete": True}, "fetch": {"state": "idle"}}})
    assert "model sharing" not in render_status({"name": "x"})
