"""Model sharing of a split GGUF set (``NAME-0000i-of-0000N.gguf``): one model, lent by layer range.

The manifest describes the parts one after the other (each part's header a region of its
own), so its identity is the loader's; a fetching member keeps the parts as sparse files
named as they are, holding exactly the pieces of its range, and loads them with the
ordinary reader; a holder of a split set lends it over the real CURVE links.
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest
import torch

from decoding.loader.gguf_source import GGUFSource
from meshd.share import manifest as mf
from meshd.share import manifest_build as mb
from meshd.share.fetch import Fetch, Holder
from meshd.share.source import PartialGGUFSource
from meshd.share.store import CachedModel, ModelCache
from tests.support.gguf_split import single_and_split
from tests.support.share_bus import Bus, close_all, shell
from tests.support.waiting import eventually

LAYERS = 5
pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def model(tmp_path):
    return single_and_split(tmp_path, LAYERS)


def same_weights(a, b):
    for x, y in zip(a.layers, b.layers, strict=True):
        for f in ("attn_norm", "qkv", "o", "mlp_norm", "gate_up", "down"):
            assert torch.equal(getattr(x, f), getattr(y, f)), f
    for f in ("embed", "final_norm", "lm_head"):
        ta, tb = getattr(a, f), getattr(b, f)
        assert (ta is None) == (tb is None) and (ta is None or torch.equal(ta, tb)), f


def test_the_manifest_of_a_split_set_is_the_loaders_model(model):
    single, parts = model
    m = mb.build(parts[0], piece_size=1000, parts=parts)
    assert m.identity == GGUFSource(parts[0]).identity
    assert [(p.name, p.size) for p in m.parts] == [(p.name, p.stat().st_size) for p in parts]
    assert [r.name for r in m.header_regions] == ["@header", "@header:2", "@header:3"]
    assert m.size == sum(p.stat().st_size for p in parts)
    assert set(m.tensor_names) == {t.name for t in GGUFSource(single).gguf_files[0].tensors}
    assert mf.Manifest.from_data(m.data) == m
    assert "parts" not in json.loads(mb.build(single, piece_size=1000).data), "a single file's manifest is unchanged"


def test_a_manifest_whose_parts_are_not_a_set_is_refused(model):
    _, parts = model
    doc = json.loads(mb.build(parts[0], piece_size=1000, parts=parts).data)
    doc["parts"][1][0] = "other-00002-of-00003.gguf"
    with pytest.raises(mf.ManifestError, match="not part of"):
        mf.Manifest.from_data(json.dumps(doc, separators=(",", ":"), sort_keys=True).encode())


class PartsHolder:
    """A holder answering from the parts on disk, read as the manifest lays them out."""

    def __init__(self, parts, manifest):
        self.data, self.m = b"".join(p.read_bytes() for p in parts), manifest

    async def get(self, i):
        await asyncio.sleep(0)  # sleep-ok: yields once, as a holder across the network would
        p = self.m.pieces[i]
        return self.data[p.offset:p.offset + p.length]


def test_a_layer_range_is_fetched_into_sparse_parts_and_loads_as_the_single_file(model, tmp_path):
    single, parts = model
    m = mb.build(parts[0], piece_size=1000, parts=parts)
    entry = ModelCache(tmp_path / "cache").create(m)
    assert [p.name for p in entry.paths] == [p.name for p in parts]
    wanted = [*m.header_pieces, *m.pieces_of(mf.needed_tensors(m.tensor_names, LAYERS, 1, 3))]
    holder = PartsHolder(parts, m)
    stats = asyncio.run(Fetch(entry, wanted, lambda: {"a": Holder("a", lambda i: True, holder.get)}).run())
    assert stats.fetched_bytes == m.bytes_of(wanted) < m.size
    for mine, theirs in zip(entry.paths, parts):
        assert os.stat(mine).st_size == theirs.stat().st_size  # same layout as each part ...
    assert sum(os.stat(p).st_blocks * 512 for p in entry.paths) < m.size  # ... holding only what was fetched
    src = PartialGGUFSource(entry)
    assert src.identity == m.identity == GGUFSource(parts[0]).identity
    assert src.missing(1, 3) == set() and src.missing(0, 1)
    same_weights(src.load_stage(1, 3), GGUFSource(single).load_stage(1, 3))
    entry.close()
    again = CachedModel.open(entry.dir)  # a restart keeps what was verified
    assert again.have == entry.have


def test_a_whole_split_set_fetched_is_verified_by_the_hash_of_all_parts(model, tmp_path):
    _, parts = model
    m = mb.build(parts[0], piece_size=1000, parts=parts)
    entry = ModelCache(tmp_path / "cache").create(m)
    holder = PartsHolder(parts, m)
    asyncio.run(Fetch(entry, range(len(m.pieces)), lambda: {"a": Holder("a", lambda i: True, holder.get)}).run())
    assert entry.verify_whole() and entry.complete
    assert [p.read_bytes() for p in entry.paths] == [p.read_bytes() for p in parts]


@pytest.fixture
def no_local_model(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHD_HOME", str(tmp_path / "empty-meshd-home"))


async def test_a_holder_of_a_split_set_lends_a_layer_range_over_the_home_links(model, tmp_path, no_local_model):
    single, parts = model
    bus = Bus()
    try:
        holder = await shell(bus, tmp_path, "holder", model=str(parts[0]))
        await holder.obtain_source()
        await eventually(lambda: holder.manifest is not None, timeout_s=30, what="the holder's manifest")
        assert holder.manifest.parts and holder.manifest.identity == GGUFSource(parts[0]).identity
        newcomer = await shell(bus, tmp_path, "newcomer")
        source = await asyncio.wait_for(newcomer.obtain_source(), 60)
        await asyncio.wait_for(newcomer.set_target(2, 4), 60)
        assert newcomer.state == "done" and not source.missing(2, 4) and source.missing(0, 1)
        assert newcomer.status()["holds"]["layers"] == [[2, 4]]
        got = await asyncio.to_thread(source.load_stage, 2, 4)
        same_weights(got, GGUFSource(single).load_stage(2, 4))
        assert source.identity == GGUFSource(parts[0]).identity
        assert len(source.parts) == 3
    finally:
        await close_all(bus)
