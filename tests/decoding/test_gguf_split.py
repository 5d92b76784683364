"""Split GGUF sets (llama.cpp's ``NAME-0000i-of-0000N.gguf``) load as one model.

How the Hub publishes most 7B+ GGUFs: the parts together are the model, so they
give the same tensors and logits as the single file, the identity covers every
part's bytes, and a set with a part missing or mixed up is refused by name.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from decoding.errors import ModelLoadError
from decoding.loader import open_model
from decoding.loader.files import sha256_of, sha256_of_files
from decoding.loader.gguf_split import parse_name, part_paths
from tests.support.gguf import write_tiny_gguf
from tests.support.gguf_split import single_and_split as split_pair, split_gguf

LAYERS = 4


@pytest.fixture
def single_and_split(tmp_path):
    return split_pair(tmp_path, LAYERS)


def logits(source, ids, stage=None):
    stage = stage or source.load_stage(0, source.config.num_layers)
    kv = stage.new_cache()
    kv.create("s", len(ids))
    return stage.forward(kv, "s", ids)


def test_three_parts_give_the_single_files_tensors_and_logits(single_and_split):
    single, parts = single_and_split
    assert [p.name for p in parts] == [f"tiny-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    one, split = open_model(single), open_model(parts[0])
    assert split.parts == parts and split.config == one.config
    assert all(len(f.tensors) < len(one.gguf_files[0].tensors) for f in split.gguf_files)  # really spread out
    for name in one._tensors:
        assert torch.equal(split.read_tensor(name), one.read_tensor(name)), name
    ids = torch.tensor([3, 17, 99, 5, 64, 1])
    torch.testing.assert_close(logits(split, ids), logits(one, ids), rtol=0, atol=0)


def test_any_part_opens_the_whole_set(single_and_split):
    _, parts = single_and_split
    assert open_model(parts[1]).parts == parts
    assert open_model(parts[2]).identity == open_model(parts[0]).identity


def test_the_identity_covers_every_part(single_and_split, tmp_path):
    _, parts = single_and_split
    ident = open_model(parts[0]).identity
    assert ident == f"{parts[0].name}@{sha256_of_files(parts)[:16]}"
    assert sha256_of_files(parts) != sha256_of(parts[0])
    # one byte of the last part's last tensor changed: another model
    data = bytearray(parts[2].read_bytes())
    data[-1] ^= 0x01
    parts[2].write_bytes(bytes(data))
    assert open_model(parts[0]).identity != ident


def test_the_identity_is_cached_per_set_and_notices_a_changed_part(single_and_split, tmp_path):
    _, parts = single_and_split
    cache = tmp_path / "tok"
    first = open_model(parts[0], cache_dir=cache).identity
    assert open_model(parts[0], cache_dir=cache).identity == first == open_model(parts[0]).identity
    data = bytearray(parts[1].read_bytes())
    data[-1] ^= 0x01
    parts[1].write_bytes(bytes(data))
    assert open_model(parts[0], cache_dir=cache).identity != first


def test_a_missing_part_is_named(single_and_split):
    _, parts = single_and_split
    parts[1].unlink()
    with pytest.raises(ModelLoadError, match="tiny-00002-of-00003.gguf missing"):
        open_model(parts[0])


def test_a_part_from_another_set_is_refused(single_and_split, tmp_path):
    single, parts = single_and_split
    (tmp_path / "two").mkdir()
    other = split_gguf(single, tmp_path / "two" / "tiny.gguf", parts=2)
    shutil.copy(other[1], parts[1])  # part 2 of 2 where part 2 of 3 belongs
    with pytest.raises(ModelLoadError, match="mixed up"):
        open_model(parts[0])


def test_a_first_part_renamed_as_a_plain_file_says_how_to_open_it(single_and_split, tmp_path):
    _, parts = single_and_split
    plain = tmp_path / "renamed.gguf"
    shutil.copy(parts[0], plain)
    with pytest.raises(ModelLoadError, match="part 1 of a 3-part split set"):
        open_model(plain)


def test_split_names():
    assert parse_name("Qwen3-8B-Q4_K_M-00002-of-00003.gguf").stem == "Qwen3-8B-Q4_K_M"
    assert parse_name("model.gguf") is None and parse_name("m-00004-of-00003.gguf") is None


def test_a_plain_file_is_its_own_only_part(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", layers=2)
    assert part_paths(path) == (path,)
    assert open_model(path).identity == f"tiny.gguf@{sha256_of(path)[:16]}"


@pytest.mark.slow
def test_a_real_model_split_in_three_tokenizes_and_answers_as_the_single_file(real_source, real_stage, tmp_path):
    """The tokenizer comes from part 1's metadata (transformers reads it), the weights from all three."""
    parts = split_gguf(real_source.path, tmp_path / "smol.gguf", parts=3)
    split = open_model(parts[0], cache_dir=tmp_path / "tok")
    text = "Turn on the kitchen lights, please."
    ids = split.tokenizer.encode(text)
    assert ids == real_source.tokenizer.encode(text)
    x = torch.tensor(ids)
    torch.testing.assert_close(logits(split, x)[-1], logits(real_source, x, real_stage)[-1], rtol=0, atol=0)
