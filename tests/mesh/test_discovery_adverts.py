"""mDNS adverts: TXT round trip, classification of peers, interface choice."""

import pytest

from meshd.mesh.discovery import (
    PROTOCOL_VERSION, REASON_OTHER_HOME, REASON_UNPAIRED, Advert, DiscoveryError, Interface, classify,
    select_interfaces)
from meshd.state import Member, key_fingerprint

KEY = "K" * 40


def advert(**kw):
    base = dict(node_id="n1", name="tv", protocol_version=PROTOCOL_VERSION, home_digest="h1",
                key_fingerprint=key_fingerprint(KEY), memory_budget_mb=2048,
                profile_digest="p", port=7410, pairing_port=7411)
    base.update(kw)
    return Advert(**base)


def test_an_advert_survives_its_txt_record():
    a = advert()
    txt = {k.encode(): v.encode() for k, v in a.txt().items()}
    assert Advert.from_txt(txt, 7410, ()) == a


def test_a_txt_record_without_required_fields_is_rejected():
    with pytest.raises(ValueError):
        Advert.from_txt({b"id": b"x"}, 1, ())


def test_a_paired_peer_of_our_home_is_admissible():
    assert classify(advert(), "me", "h1", {"n1": Member("n1", "tv", KEY)}) is None


def test_peers_of_other_homes_are_ignored():
    assert classify(advert(home_digest="h2"), "me", "h1", {}) == REASON_OTHER_HOME


def test_a_peer_whose_key_is_not_on_the_allow_list_is_unpaired():
    assert classify(advert(), "me", "h1", {}) == REASON_UNPAIRED
    other = Member("n1", "tv", "Z" * 40)  # same node id, different key
    assert classify(advert(), "me", "h1", {"n1": other}) == REASON_UNPAIRED


def test_another_protocol_version_is_named():
    assert "protocol version 99" in classify(advert(protocol_version=99), "me", "h1", {})


IFACES = [Interface("lo", ("127.0.0.1",)), Interface("eth0", ("192.0.2.2",)),
          Interface("wlan0", ("10.0.0.5",))]


def test_by_default_every_non_loopback_interface_is_used():
    assert [i.name for i in select_interfaces(None, IFACES)] == ["eth0", "wlan0"]
    assert [i.name for i in select_interfaces(None, IFACES[:1])] == ["lo"]


def test_an_interface_can_be_chosen_by_name_or_address():
    assert select_interfaces("eth0", IFACES) == [IFACES[1]]
    assert select_interfaces("127.0.0.1", IFACES) == [IFACES[0]]
    with pytest.raises(DiscoveryError, match="no network interface"):
        select_interfaces("eth9", IFACES)
