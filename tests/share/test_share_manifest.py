"""Model sharing, the pure parts: manifests, piece runs, the rate bucket, which tensors a stage needs,
who holds what, and when a plan must wait. Checked against brute force where one exists."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.share import manifest as mf
from meshd.share import manifest_build as mb
from meshd.share.gate import Holdings, gate_plan, holdings_of
from meshd.share.runs import from_runs, to_runs
from meshd.share.throttle import RateError, TokenBucket, parse_rate
from tests.support.gguf import write_tiny_gguf

# ------------------------------------------------------------------ regions and pieces tile the file


@st.composite
def file_layouts(draw):
    """A file size, where tensor data starts, and non-overlapping tensors in any order."""
    header = draw(st.integers(1, 300))
    pos, tensors = header, []
    for i in range(draw(st.integers(0, 12))):
        pos += draw(st.integers(0, 40))  # alignment gap
        n = draw(st.integers(1, 500))
        tensors.append((f"t{i}", pos, n))
        pos += n
    size = pos + draw(st.integers(0, 40))
    return size, header, draw(st.permutations(tensors))


@settings(max_examples=200, deadline=None)
@given(file_layouts(), st.integers(1, 97))
def test_regions_and_pieces_tile_the_file_exactly(layout, piece_size):
    size, header, tensors = layout
    spans = mb.layout(size, header, tensors)
    owner = [None] * size  # brute force: which region owns every byte
    for k, (_, off, n) in enumerate(spans):
        for b in range(off, off + n):
            assert owner[b] is None
            owner[b] = k
    assert None not in owner
    assert spans[0] == (mf.HEADER, 0, header)
    assert {(n, o, ln) for n, o, ln in spans if n != mf.GAP} == {(mf.HEADER, 0, header), *tensors}
    cuts = mf.split(spans, piece_size)
    covered = [None] * size
    for ri, off, n in cuts:
        assert 0 < n <= piece_size
        for b in range(off, off + n):
            assert covered[b] is None and owner[b] == ri  # a piece never straddles regions
            covered[b] = ri
    assert None not in covered
    assert len(cuts) == sum(math.ceil(n / piece_size) for _, _, n in spans)


def test_overlapping_tensors_or_tensors_in_the_header_are_refused():
    with pytest.raises(mf.ManifestError):
        mb.layout(100, 10, [("a", 20, 10), ("b", 25, 10)])
    with pytest.raises(mf.ManifestError):
        mb.layout(100, 10, [("a", 5, 10)])
    with pytest.raises(mf.ManifestError):
        mb.layout(100, 10, [("a", 95, 10)])


@settings(max_examples=200, deadline=None)
@given(st.sets(st.integers(0, 300)))
def test_runs_hold_exactly_the_indices(indices):
    runs = to_runs(indices)
    assert from_runs(runs) == indices
    assert all(a < b for a, b in runs) and all(runs[i][1] < runs[i + 1][0] for i in range(len(runs) - 1))


@pytest.mark.parametrize("bad", [[[3, 1]], [[0, 5, 6]], [["a", 2]], [[-1, 2]], [[0, 11]]])
def test_malformed_runs_are_refused(bad):
    with pytest.raises(ValueError):
        from_runs(bad, limit=10)


# ------------------------------------------------------------------ the manifest of a real file


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", layers=5, rope_freqs=True)
    return path, mb.build(path, piece_size=1000)


def test_a_manifest_describes_every_byte_of_its_file(tiny):
    import hashlib

    path, m = tiny
    data = path.read_bytes()
    assert m.size == len(data) and m.sha256 == hashlib.sha256(data).hexdigest()
    assert m.identity == f"tiny.gguf@{m.sha256[:16]}"
    for p in m.pieces:
        assert hashlib.sha256(data[p.offset:p.offset + p.length]).hexdigest() == p.sha256
    for r in m.regions:
        assert hashlib.sha256(data[r.offset:r.end]).hexdigest() == r.sha256
        assert [m.region_of_piece[i] for i in r.piece_range] == [m.regions.index(r)] * r.pieces
    assert any(r.name == mf.GAP for r in m.regions), "the tiny file should have alignment gaps"
    assert m.num_layers == 5


def test_the_manifest_travels_as_canonical_bytes_with_a_stable_digest(tiny):
    path, m = tiny
    again = mf.Manifest.from_data(m.data)
    assert again.data == m.data and again.digest == m.digest == mb.build(path, piece_size=1000).digest
    doc = json.loads(m.data)
    doc["pieces"][3] = "0" * 64  # a tampered digest is still a manifest, but another one
    assert mf.Manifest.from_data(json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()).digest != m.digest


@pytest.mark.parametrize("mutate", [
    lambda d: d.update(format=9),
    lambda d: d["regions"].pop(2),  # a hole in the tiling
    lambda d: d["pieces"].pop(),  # a piece without a digest
    lambda d: d.update(piece_size=1 << 30),  # pieces too large to hold in memory
    lambda d: d.update(name="../../etc/passwd"),
    lambda d: d["regions"][1].__setitem__(3, "not hex"),
])
def test_malformed_manifests_are_refused(tiny, mutate):
    doc = json.loads(tiny[1].data)
    mutate(doc)
    with pytest.raises(mf.ManifestError):
        mf.Manifest.from_data(json.dumps(doc, separators=(",", ":"), sort_keys=True).encode())


def test_a_manifest_that_disagrees_with_the_files_header_is_refused(tiny, tmp_path):
    path, m = tiny
    mb.check_against_header(m, path)
    spans = [(r.name, r.offset, r.length, r.sha256) for r in m.regions]
    i = next(k for k, s in enumerate(spans) if s[0] == mf.GAP)  # move a gap before the tensor it follows
    (n0, o0, l0, s0), (n1, _, l1, s1) = spans[i - 1], spans[i]
    spans[i - 1:i + 1] = [(n1, o0, l1, s1), (n0, o0 + l1, l0, s0)]
    moved = mf.assemble(m.name, m.sha256, m.size, m.piece_size, spans,
                        [p.sha256 for p in m.pieces])  # digests no longer matter: the layout is wrong
    with pytest.raises(mf.ManifestError):
        mb.check_against_header(moved, path)


# ------------------------------------------------------------------ which tensors a stage reads


class Recording:
    """A model source that records the tensors the real stage loader asks for."""

    def __init__(self, source):
        self.source, self.read = source, set()
        self.config, self.path = source.config, source.path

    def read_tensor(self, name):
        self.read.add(name)
        return self.source.read_tensor(name)

    def rope_freq_factors(self):
        return self.read_tensor("rope_freqs") if self.source.has_tensor("rope_freqs") else None


@pytest.mark.parametrize("tied,rope", [(False, False), (True, False), (False, True)])
def test_needed_tensors_are_exactly_what_the_stage_loader_reads(tmp_path, tied, rope):
    from decoding.loader.gguf_source import GGUFSource
    from decoding.models.llama import StageModel

    source = GGUFSource(write_tiny_gguf(tmp_path / "m.gguf", layers=4, tied=tied, rope_freqs=rope))
    gguf_name = {canon: t.name for canon, t in source._tensors.items()}
    names = [t.name for t in source.gguf_files[0].tensors]
    for first in range(4):
        for end in range(first + 1, 5):
            rec = Recording(source)
            StageModel.from_source(rec, first, end)
            assert {gguf_name[n] for n in rec.read} == mf.needed_tensors(names, 4, first, end), (first, end)


def test_the_embedded_models_layer_ranges_need_their_share_of_the_file(real_source):
    """SmolLM2 ties its head to the embedding: the last stage needs the embedding too."""
    names = [t.name for t in real_source.gguf_files[0].tensors]
    mid = mf.needed_tensors(names, 30, 10, 20)
    assert "token_embd.weight" not in mid and all(mf.block_of(n) in range(10, 20) for n in mid)
    last = mf.needed_tensors(names, 30, 20, 30)
    assert {"token_embd.weight", "output_norm.weight"} <= last
    with pytest.raises(ValueError):
        mf.needed_tensors(names, 30, 20, 31)


# ------------------------------------------------------------------ holdings and the plan gate


@settings(max_examples=100, deadline=None)
@given(st.sets(st.integers(0, 5)), st.sets(st.sampled_from(["token_embd.weight", "output_norm.weight"])),
       st.integers(0, 5), st.integers(1, 6))
def test_holdings_cover_a_range_exactly_when_every_needed_tensor_is_held(layers, others, first, size):
    end = min(6, first + size)
    names = [f"blk.{i}.{t}" for i in range(6) for t in ("attn_q.weight", "ffn_up.weight")] + [
        "token_embd.weight", "output_norm.weight"]
    held = [n for n in names if (mf.block_of(n) in layers) or n in others]
    h = holdings_of(names, held, header=True, complete=False)
    assert h.layers == frozenset(layers) and h.tensors == frozenset(others)
    needed = mf.needed_tensors(names, 6, first, end)
    assert h.covers(needed) == (set(needed) <= set(held))  # brute force: every needed name held
    assert Holdings(complete=True).covers(needed)


def test_a_layer_counts_as_held_only_when_all_its_tensors_are():
    names = ["blk.0.a", "blk.0.b", "blk.1.a"]
    assert holdings_of(names, ["blk.0.a", "blk.1.a"], True, False).layers == frozenset({1})


def _plan(*stages, n=30):
    return SimpleNamespace(stages=tuple(SimpleNamespace(node_id=a, first=f, end=e) for a, f, e in stages),
                           num_layers=n)


def test_a_plan_waits_while_the_current_one_still_serves():
    held = {"a": (0, 30), "b": (0, 0)}
    covers = lambda n, f, e: held[n][0] <= f and e <= held[n][1]  # noqa: E731
    current, candidate = _plan(("a", 0, 30)), _plan(("a", 0, 15), ("b", 15, 30))
    d = gate_plan(candidate, current, ["a", "b"], covers, lambda ids: _plan(("a", 0, 30)), ["a"])
    assert d.adopt is None and d.waiting == {"b": (15, 30)}
    held["b"] = (15, 30)
    d = gate_plan(candidate, current, ["a", "b"], covers, lambda ids: _plan(("a", 0, 30)), ["a"])
    assert d.adopt is candidate and d.waiting == {}


def test_when_a_member_left_the_members_that_can_serve_at_once_take_over():
    held = {"a": (0, 30), "b": (10, 20), "c": (20, 30)}
    covers = lambda n, f, e: held[n][0] <= f and e <= held[n][1]  # noqa: E731
    current = _plan(("a", 0, 10), ("b", 10, 20), ("c", 20, 30))  # c is gone
    candidate = _plan(("a", 0, 15), ("b", 15, 30))
    plans = {("a",): _plan(("a", 0, 30))}
    d = gate_plan(candidate, current, ["a", "b"], covers, lambda ids: plans[tuple(ids)], ["a"])
    assert d.adopt is plans[("a",)] and d.waiting == {"b": (15, 30)}


def test_when_nobody_can_serve_at_once_the_plan_goes_ahead_and_stages_fetch_first():
    covers = lambda n, f, e: False  # noqa: E731
    candidate = _plan(("b", 0, 15), ("c", 15, 30))
    d = gate_plan(candidate, None, ["b", "c"], covers, lambda ids: _plan(*[(i, 0, 30) for i in ids[:1]]), [])
    assert d.adopt is candidate and set(d.waiting) == {"b", "c"}


# ------------------------------------------------------------------ the rate bucket


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=40), st.floats(100, 1e6), st.integers(1, 5000))
def test_the_bucket_never_lets_more_than_rate_times_time_plus_burst_through(sizes, rate, burst):
    bucket, now, sent = TokenBucket(rate, burst), 0.0, 0
    for n in sizes:  # each request goes when the bucket says, at the latest clock
        now += bucket.delay(n, now)
        sent += n
        assert sent <= rate * now + burst + 1e-6 * sent
    # and it is not slower than it must be: the last byte leaves as soon as the rate allows
    assert now <= max(0.0, (sent - burst) / rate) + 1e-6


def test_share_rates_read_like_link_speeds():
    assert parse_rate("80mbit") == 10e6
    assert parse_rate("12.5MB/s") == 12.5e6
    assert parse_rate("8") == 1e6  # a bare number is Mbit/s
    assert parse_rate(None) is None and parse_rate("none") is None and parse_rate("0") is None
    with pytest.raises(RateError):
        parse_rate("fast")
