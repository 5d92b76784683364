"""The home's cloud pairing record: validated, ordered, and the newest wins on every member.

`meshd.cloud.record` is pure; `meshd.cloud.sync.CloudSync` is driven here without an engine
(what it would send, what it keeps, what it writes to `cloud.json`).
"""

import itertools
import json
import math
import time

import pytest

from meshd.cloud.held import change_pairing, paired_cloud
from meshd.cloud.record import CloudRecord, heartbeat_key, newer
from meshd.cloud.sync import CloudSync
from meshd.state import StateDir
from transport.keys import Keypair

KEY = Keypair.generate().public.decode()


def paired(at: float, port: int = 5730, model: str = "big") -> CloudRecord:
    return CloudRecord(at, f"tcp://verifier.example:{port}", KEY, model, "tok-fp")


def test_a_pairing_and_a_tombstone_survive_their_json_form_including_the_form_pair_wrote_before():
    for rec in (paired(1700000000.5), CloudRecord(1700000001.0)):
        assert CloudRecord.from_json(json.loads(json.dumps(rec.to_json()))) == rec
    legacy = {"address": "tcp://h:5730", "server_key": KEY, "model": "m", "tokenizer": "t", "paired_at": 12.0}
    assert CloudRecord.from_json(legacy) == CloudRecord(12.0, "tcp://h:5730", KEY, "m", "t")
    assert CloudRecord.from_json({"unpaired_at": 3}).paired is False


@pytest.mark.parametrize("value", [
    None, [], "tcp://h:1", {"unpaired_at": "yesterday"}, {"unpaired_at": -1}, {"unpaired_at": math.inf},
    {"unpaired_at": True}, {"address": "tcp://h:1", "server_key": KEY, "paired_at": math.nan},
    {"address": "http://h:1", "server_key": KEY, "paired_at": 1},
    {"address": "tcp://h", "server_key": KEY, "paired_at": 1},
    {"address": "tcp://h:1", "server_key": "short", "paired_at": 1},
    {"address": "tcp://h:1", "server_key": KEY, "model": 7, "paired_at": 1},
    {"address": "tcp://h:1" + "x" * 600, "server_key": KEY, "paired_at": 1},
    {"address": "tcp://h:1", "server_key": KEY},
])
def test_hostile_or_malformed_records_are_refused_with_a_reason(value):
    with pytest.raises(ValueError):
        CloudRecord.from_json(value)


def test_the_newest_change_wins_and_equal_times_settle_the_same_way_everywhere():
    a, b, gone = paired(10.0), paired(20.0, 6000), CloudRecord(30.0)
    assert newer(a, None) and newer(b, a) and not newer(a, b) and newer(gone, b) and not newer(None, a)
    twins = [paired(50.0, 5730), paired(50.0, 5731), CloudRecord(50.0)]
    # Whatever order members hear of same-instant changes in, they all keep the same one.
    kept = set()
    for order in itertools.permutations(twins):
        held = None
        for rec in order:
            if newer(rec, held):
                held = rec
        kept.add(held)
    assert len(kept) == 1
    assert heartbeat_key(None) == (0.0, "") and heartbeat_key(b) == b.order


def _sync(tmp_path, name) -> tuple[CloudSync, StateDir]:
    state = StateDir(tmp_path / name).ensure()
    errors = []
    return CloudSync(state, 0.2, None, home_keys=lambda: [], on_error=errors.append), state


def test_members_converge_on_the_newest_record_through_their_heartbeats(tmp_path):
    alpha, alpha_state = _sync(tmp_path, "alpha")
    beta, beta_state = _sync(tmp_path, "beta")
    change_pairing(alpha_state, {"address": "tcp://v:5730", "server_key": KEY, "model": "big", "tokenizer": "t",
                           "paired_at": 100.0})  # `meshd cloud pair` on alpha
    alpha.tick()
    assert alpha.held.paired and beta.share_for(**_hb(alpha)) is None  # beta has nothing newer to offer
    share = alpha.share_for(**_hb(beta))
    assert share is not None
    beta.receive(share.record, "alpha")
    assert beta.held == alpha.held and paired_cloud(beta_state)["address"] == "tcp://v:5730"
    assert alpha.share_for(**_hb(beta)) is None  # converged: nothing more is sent

    change_pairing(beta_state, None)  # `meshd cloud unpair` on beta, later
    beta.tick()
    alpha.receive(beta.share_for(**_hb(alpha)).record, "beta")
    assert alpha.held.paired is False and paired_cloud(alpha_state) is None
    alpha.receive(share.record, "gamma")  # a member back from a long absence offers the old pairing
    assert alpha.held.paired is False and json.loads((alpha_state.root / "cloud.json").read_text()).keys() == {
        "unpaired_at"}


def test_a_hostile_record_from_a_member_is_logged_and_changes_nothing(tmp_path):
    sync, state = _sync(tmp_path, "alpha")
    sync.receive({"address": "tcp://evil:1", "server_key": "x" * 39, "paired_at": 1.0}, "mallory")
    # A clock years ahead would make its record outrank every later pairing: refused too.
    sync.receive({"address": "tcp://evil:1", "server_key": KEY, "paired_at": 1e18}, "mallory")
    assert sync.held is None and not (state.root / "cloud.json").exists()


def _hb(sync: CloudSync) -> dict:
    f = sync.heartbeat_fields()
    return {"changed_at": f["cloud_changed_at"], "digest": f["cloud_digest"]}


def test_a_member_whose_clock_is_behind_still_makes_the_newest_change(tmp_path):
    sync, state = _sync(tmp_path, "late-clock")
    ahead = CloudRecord(time.time() + 3600, "tcp://v:5730", KEY, "big", "t")  # from a member an hour ahead
    sync.receive(ahead.to_json(), "alpha")
    assert sync.held == ahead
    change_pairing(state, None)  # `meshd cloud unpair` here, with a clock behind alpha's
    sync.tick()
    assert sync.held.paired is False and newer(sync.held, ahead)
    assert sync.share_for(*ahead.order) is not None  # and it tells alpha


def test_a_time_stamp_beyond_any_float_is_refused_not_raised():
    with pytest.raises(ValueError):
        CloudRecord.from_json({"unpaired_at": 10 ** 400})
