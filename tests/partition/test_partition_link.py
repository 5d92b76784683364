"""Links between stages: ``--link`` parsing and the transfer-time model."""

import math

import pytest

from partition.link import LOCAL, LinkModel, LinkSpecError, parse_link


@pytest.mark.parametrize("spec, bandwidth_Bps, rtt_s", [
    ("100mbit,2ms", 12.5e6, 0.002),
    ("1gbit,0.5ms", 125e6, 0.0005),
    ("10Mbit, 300us", 1.25e6, 0.0003),
    ("12.5MB/s,1ms", 12.5e6, 0.001),
    ("100Mb/s,2", 12.5e6, 0.002),  # bare RTT number = milliseconds
    ("54mbit", 6.75e6, 0.001),  # RTT defaults to 1 ms
])
def test_link_specs_are_read_in_the_units_people_quote(spec, bandwidth_Bps, rtt_s):
    link = parse_link(spec)
    assert link.bandwidth_Bps == pytest.approx(bandwidth_Bps)
    assert link.rtt_s == pytest.approx(rtt_s)


def test_local_link_is_free():
    assert parse_link("local") is LOCAL
    assert LOCAL.transfer_s(10**9) == 0.0


@pytest.mark.parametrize("spec", ["", "fast", "100parsecs,2ms", "100mbit,2lightyears", "0mbit,1ms",
                                  "1,2,3"])
def test_unreadable_link_specs_are_user_errors(spec):
    with pytest.raises(LinkSpecError):
        parse_link(spec)


def test_transfer_time_is_bytes_over_bandwidth_plus_rtt():
    link = LinkModel(1e6, 0.01)
    assert link.transfer_s(2e6) == pytest.approx(2.01)
    # activations: S x H x dtype bytes
    assert link.activation_transfer_s(1000, 500, 4) == pytest.approx(2.01)


def test_link_round_trips_through_json_including_unlimited_bandwidth():
    for link in (LinkModel(12.5e6, 0.002), LOCAL):
        back = LinkModel.from_dict(link.to_dict())
        assert back == link
    assert LOCAL.to_dict()["bandwidth_Bps"] is None
    assert not math.isinf(parse_link("1gbit").bandwidth_Bps)
