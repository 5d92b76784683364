"""Sharing services talking over real CURVE links: a member without the model gets it from two holders,
one of which sends corrupt bytes; bad requests get clear refusals.

The services are the real ones; only the daemon around them is a small shell
(config, allow-listed transport node, membership that says everyone is ready)
whose adverts and targets go straight to the other services.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from decoding.loader.gguf_source import GGUFSource
from meshd.share.messages import ManifestRequest, PieceRequest
from meshd.share.service import ShareService
from transport.errors import RemoteError
from tests.support.gguf import write_tiny_gguf
from tests.support.logs import all_log_events
from tests.support.share_bus import Bus, close_all, shell
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(120)


class EvilShare(ShareService):
    """Flips one byte of every piece it lends (after its own check passed)."""

    def __init__(self, deps):
        super().__init__(deps)
        honest = self.endpoint.read_checked

        def flipped(i):
            data = bytearray(honest(i))
            data[len(data) // 2] ^= 0x10
            return bytes(data)
        self.endpoint.read_checked = flipped


@pytest.fixture
def tiny(tmp_path):
    return write_tiny_gguf(tmp_path / "tiny.gguf", layers=5)


@pytest.fixture
def no_local_model(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHD_HOME", str(tmp_path / "empty-meshd-home"))


async def test_a_member_without_the_model_fetches_its_layers_and_shuns_the_one_sending_bad_bytes(
        tmp_path, tiny, no_local_model):
    bus = Bus()
    try:
        honest = await shell(bus, tmp_path, "honest", model=str(tiny))
        evil = await shell(bus, tmp_path, "evil", model=str(tiny), cls=EvilShare)
        for holder in (honest, evil):
            await holder.obtain_source()
        await eventually(lambda: honest.manifest is not None and evil.manifest is not None, timeout_s=30, what="manifests")
        newcomer = await shell(bus, tmp_path, "newcomer")
        with all_log_events() as logs:
            source = await asyncio.wait_for(newcomer.obtain_source(), 60)
            await asyncio.wait_for(newcomer.set_target(1, 3), 60)
            assert newcomer.state == "done" and not source.missing(1, 3)
        assert set(newcomer.peers.banned) == {"evil"}, newcomer.status()
        assert any(e["event"] == "share_peer_corrupt" and e["peer"] == "evil" for e in logs)
        stats = newcomer.status()
        assert stats["holds"]["layers"] == [[1, 3]] and not stats["holds"]["complete"]
        want, got = GGUFSource(tiny).load_stage(1, 3), await asyncio.to_thread(source.load_stage, 1, 3)
        for a, b in zip(want.layers, got.layers):
            assert torch.equal(a.qkv, b.qkv) and torch.equal(a.down, b.down)
        assert source.identity == GGUFSource(tiny).identity
        # the newcomer now lends what it holds to the next one, and nobody asks the evil member again
        await eventually(lambda: "newcomer" in honest.peers.peers and honest.peers.peers["newcomer"].holdings.layers,
                         timeout_s=30, what="the newcomer's advert")
        assert honest.peers.peers["newcomer"].holdings.layers == frozenset({1, 2})
    finally:
        await close_all(bus)


async def test_bad_share_requests_get_clear_refusals(tmp_path, tiny):
    bus = Bus()
    try:
        holder = await shell(bus, tmp_path, "holder", model=str(tiny))
        asker = await shell(bus, tmp_path, "asker")
        await holder.obtain_source()
        await eventually(lambda: holder.manifest is not None, timeout_s=30, what="the manifest")
        peer = await asker.deps.transport.connect(f"tcp://127.0.0.1:{holder.port}",
                                                  server_key=holder.deps.transport.public_key, timeout=10)
        sha = holder.manifest.sha256
        with pytest.raises(RemoteError, match="bad_request"):
            await peer.request(PieceRequest(sha, 10**6))
        with pytest.raises(RemoteError, match="not_held"):
            await peer.request(ManifestRequest("0" * 64))
        with pytest.raises(RemoteError, match="not_held"):
            await peer.request(PieceRequest("0" * 64, 0))
        reply = await peer.request(PieceRequest(sha, 0))  # and it keeps serving
        assert reply.index == 0 and len(reply.data) == holder.manifest.pieces[0].length
        assert holder.endpoint.served["refused"] == 3
    finally:
        await close_all(bus)


async def test_a_device_hashes_its_file_for_lending_only_once_it_serves_and_keeps_the_manifest(tmp_path, tiny):
    """On a one-core device the hashing would take the start's CPU: it waits for the device to be ready."""
    ready = asyncio.Event()
    bus = Bus()
    try:
        holder = await shell(bus, tmp_path, "holder", model=str(tiny), device_ready=ready.wait)
        await holder.obtain_source()
        await asyncio.sleep(0.5)  # sleep-ok: nothing may happen in this time
        assert holder.manifest is None
        ready.set()
        await eventually(lambda: holder.manifest is not None, timeout_s=30, what="the manifest, once ready")
    finally:
        await close_all(bus)
    # a restart reads the kept manifest without waiting
    bus = Bus()
    try:
        again = await shell(bus, tmp_path, "holder", model=str(tiny), device_ready=asyncio.Event().wait)
        await again.obtain_source()
        await eventually(lambda: again.manifest is not None, timeout_s=30, what="the kept manifest")
    finally:
        await close_all(bus)
