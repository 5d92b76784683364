"""A partial model on disk: only a layer range's tensors fetched, loaded with the ordinary GGUF reader,
never a tensor that was not fetched; bad bytes caught in transit and on disk; fetches resume."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from decoding.errors import ModelLoadError
from decoding.loader.gguf_source import GGUFSource
from meshd.share import manifest as mf
from meshd.share import manifest_build as mb
from meshd.share.fetch import Fetch, Holder, NoHolder
from meshd.share.source import PartialGGUFSource
from meshd.share.store import CachedModel, ModelCache
from tests.support.gguf import write_tiny_gguf
from tests.support.waiting import eventually

LAYERS = 5


@pytest.fixture
def model(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", layers=LAYERS, rope_freqs=True)
    return path, mb.build(path, piece_size=1000)


class FileHolder:
    """A holder answering from the original file; ``flip`` corrupts one byte of every piece it sends."""

    def __init__(self, path, manifest, flip=False):
        self.data, self.m, self.flip, self.asked = path.read_bytes(), manifest, flip, 0

    async def get(self, i):
        self.asked += 1
        await asyncio.sleep(0)  # sleep-ok: yields once, as a holder across the network would
        p = self.m.pieces[i]
        b = bytearray(self.data[p.offset:p.offset + p.length])
        if self.flip:
            b[len(b) // 2] ^= 0x01
        return bytes(b)

    def holder(self, name):
        return Holder(name, lambda i: True, self.get)


def wanted(m, first, end):
    return [*m.header.piece_range, *m.pieces_of(mf.needed_tensors(m.tensor_names, LAYERS, first, end))]


def fetch(entry, pieces, holders, **kw):
    return asyncio.run(Fetch(entry, pieces, lambda: holders, **kw).run())


def same_weights(a, b):
    for x, y in zip(a.layers, b.layers):
        for f in ("attn_norm", "qkv", "o", "mlp_norm", "gate_up", "down"):
            assert torch.equal(getattr(x, f), getattr(y, f)), f
    for f in ("embed", "final_norm", "lm_head"):
        ta, tb = getattr(a, f), getattr(b, f)
        assert (ta is None) == (tb is None) and (ta is None or torch.equal(ta, tb)), f
    assert torch.equal(a.inv_freq, b.inv_freq)


def test_a_layer_range_loads_from_a_sparse_copy_holding_only_its_tensors(model, tmp_path):
    path, m = model
    entry = ModelCache(tmp_path / "cache").create(m)
    stats = fetch(entry, wanted(m, 1, 3), {"alpha": FileHolder(path, m).holder("alpha")})
    assert stats.fetched_bytes == m.bytes_of(wanted(m, 1, 3)) < m.size
    assert os.stat(entry.path).st_size == m.size  # same layout as the original ...
    assert os.stat(entry.path).st_blocks * 512 < m.size  # ... but only the fetched blocks are on disk
    src = PartialGGUFSource(entry)
    assert src.identity == m.identity == GGUFSource(path).identity
    same_weights(src.load_stage(1, 3), GGUFSource(path).load_stage(1, 3))


@pytest.mark.parametrize("first,end,tensor", [(0, 1, "blk.0"), (3, 5, "blk.3"), (1, 2, "token_embd")])
def test_a_tensor_that_was_not_fetched_fails_loudly_instead_of_reading_zeros(model, tmp_path, first, end, tensor):
    path, m = model
    entry = ModelCache(tmp_path / "cache").create(m)
    fetch(entry, wanted(m, 1, 2) if tensor == "token_embd" else [*m.header.piece_range],
          {"alpha": FileHolder(path, m).holder("alpha")})
    src = PartialGGUFSource(entry)
    with pytest.raises(ModelLoadError, match=f"{tensor}.*has not been fetched"):
        src.load_stage(first, end) if tensor != "token_embd" else src.read_tensor("embed")


def test_no_header_no_source(model, tmp_path):
    _, m = model
    with pytest.raises(ModelLoadError, match="header"):
        PartialGGUFSource(ModelCache(tmp_path / "cache").create(m))


def test_a_member_sending_a_tampered_byte_is_caught_banned_and_the_fetch_finishes_from_another(model, tmp_path):
    path, m = model
    entry = ModelCache(tmp_path / "cache").create(m)
    evil, honest = FileHolder(path, m, flip=True), FileHolder(path, m)
    banned: dict[str, str] = {}
    stats = fetch(entry, wanted(m, 0, LAYERS), {"evil": evil.holder("evil"), "honest": honest.holder("honest")},
                  banned=banned)
    assert "evil" in banned and "sha256" in banned["evil"]
    assert stats.corrupt >= 1 and stats.by_holder == {"honest": stats.fetched_bytes}
    asked = evil.asked
    fetch(entry, [*range(len(m.pieces))], {"evil": evil.holder("evil"), "honest": honest.holder("honest")},
          banned=banned)
    assert evil.asked == asked, "a member that sent corrupt bytes is not asked again"
    assert entry.verify_whole() and entry.complete
    assert entry.path.read_bytes() == path.read_bytes()


def test_when_only_a_corrupt_member_holds_the_pieces_the_fetch_stops_with_a_clear_error(model, tmp_path):
    path, m = model
    entry = ModelCache(tmp_path / "cache").create(m)
    with pytest.raises(NoHolder, match="no reachable member holds"):
        fetch(entry, wanted(m, 0, 1), {"evil": FileHolder(path, m, flip=True).holder("evil")}, stall_s=0.5)
    assert not entry.have, "nothing unverified was recorded"


def test_a_byte_gone_bad_on_disk_is_caught_before_use_and_fetched_again(model, tmp_path):
    path, m = model
    entry = ModelCache(tmp_path / "cache").create(m)
    holder = FileHolder(path, m)
    fetch(entry, wanted(m, 2, 4), {"alpha": holder.holder("alpha")})
    region = m.by_name["blk.3.ffn_up.weight"]
    with open(entry.path, "r+b") as f:  # bit rot after the fetch
        f.seek(region.offset + 7)
        b = f.read(1)
        f.seek(region.offset + 7)
        f.write(bytes([b[0] ^ 0x80]))
    with pytest.raises(ModelLoadError, match="does not match its digest"):
        PartialGGUFSource(entry).load_stage(2, 4)
    assert not set(region.piece_range) & entry.have, "the damaged tensor's pieces were dropped"

    refetched = []

    def ensure(first, end):  # what the sharing service does: fetch what the range lacks
        refetched.append((first, end))
        fetch(entry, wanted(m, first, end), {"alpha": holder.holder("alpha")})

    with open(entry.path, "r+b") as f:  # the damage is still on disk; reloading refetches it
        f.seek(region.offset + 7)
        assert f.read(1) != path.read_bytes()[region.offset + 7:region.offset + 8]
    stage = PartialGGUFSource(entry, ensure=ensure).load_stage(2, 4)
    assert refetched == [(2, 4)]
    same_weights(stage, GGUFSource(path).load_stage(2, 4))


def test_an_interrupted_fetch_resumes_from_what_it_recorded(model, tmp_path):
    path, m = model
    root = tmp_path / "cache"
    entry = ModelCache(root).create(m)
    holder = FileHolder(path, m)
    gate = asyncio.Event()
    count = 0

    async def slow(i):  # lets 10 pieces through, then hangs until cancelled: a kill mid-fetch
        nonlocal count
        count += 1
        if count > 10:
            await gate.wait()
        return await holder.get(i)

    async def interrupted():
        task = asyncio.create_task(Fetch(entry, wanted(m, 0, LAYERS), lambda: {"a": Holder("a", lambda i: True,
                                                                                           slow)}).run())
        await eventually(lambda: len(entry.have) >= 10, 120, "ten pieces fetched before the cancel")
        task.cancel()
        async with asyncio.timeout(60):  # a cancelled fetch stops (it once swallowed the cancel and looped)
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(interrupted())
    again = CachedModel.open(root / m.sha256)  # what a restarted daemon finds
    resumed = set(again.have)
    assert len(resumed) == 10 and resumed <= set(wanted(m, 0, LAYERS))
    stats = fetch(again, wanted(m, 0, LAYERS), {"a": holder.holder("a")})
    assert stats.had_bytes == m.bytes_of(resumed) > 0
    assert stats.had_bytes + stats.fetched_bytes == m.bytes_of(wanted(m, 0, LAYERS))
    assert stats.fetched_bytes < m.bytes_of(wanted(m, 0, LAYERS))
    same_weights(PartialGGUFSource(again).load_stage(0, LAYERS), GGUFSource(path).load_stage(0, LAYERS))


def test_a_cache_record_that_is_unreadable_trusts_nothing(model, tmp_path):
    path, m = model
    root = tmp_path / "cache"
    entry = ModelCache(root).create(m)
    fetch(entry, wanted(m, 0, 1), {"a": FileHolder(path, m).holder("a")})
    (root / m.sha256 / "share-state.json").write_text("{broken")
    assert CachedModel.open(root / m.sha256).have == set()


def test_whole_file_fetch_is_verified_by_its_sha256(model, tmp_path):
    path, m = model
    entry = ModelCache(tmp_path / "cache").create(m)
    fetch(entry, range(len(m.pieces)), {"a": FileHolder(path, m).holder("a")})
    assert entry.verify_whole() and entry.complete and entry.holdings().complete
    reopened = CachedModel.open(entry.dir)
    assert reopened.complete and len(reopened.have) == len(m.pieces)
