"""Unusable models and prompts fail early with a message naming the file and the problem."""

import json
import subprocess
import sys

import pytest

from decoding.errors import ContextOverflow, ModelLoadError, UnsupportedArchitecture
from decoding.generate import generate
from decoding.loader import open_model
from decoding.pipeline_local import LocalPipeline
from meshd.model import store as model_store
from meshd.model.store import ModelNotAvailable


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(ModelNotAvailable, match="model not found: .*nope.gguf"):
        model_store.open_model(tmp_path / "nope.gguf")
    with pytest.raises(ModelLoadError, match="nope.gguf: not a file or directory"):
        open_model(tmp_path / "nope.gguf")  # the loader alone: paths only, its own error


def test_the_loader_needs_a_path_the_default_model_is_meshds_business():
    with pytest.raises(ModelLoadError, match="no model path given"):
        open_model(None)


def test_wrong_format_says_what_was_expected(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"PK\x03\x04 definitely not a model")
    with pytest.raises(ModelLoadError, match="weights.bin: unrecognised model format"):
        open_model(f)


def test_truncated_gguf_is_reported_as_corrupt(tmp_path, real_source):
    f = tmp_path / "cut.gguf"
    f.write_bytes(real_source.path.read_bytes()[: 1 << 20])
    with pytest.raises(ModelLoadError, match="cut.gguf"):
        open_model(f).config


def test_unsupported_architecture_in_hf_dir(tmp_path, tiny_llama):
    d = tmp_path / "gpt2ish"
    d.mkdir()
    src_dir = tiny_llama[0]
    for p in src_dir.iterdir():
        (d / p.name).write_bytes(p.read_bytes())
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitecture, match="gpt2ish: model_type 'gpt2' is not supported"):
        open_model(d).config


def test_unsupported_architecture_in_gguf(tmp_path):
    import gguf
    import numpy as np

    f = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(f), "falcon")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedArchitecture, match="falcon.gguf: architecture 'falcon'"):
        open_model(f).config


def test_prompt_longer_than_the_context_is_refused(tiny_llama):
    pipe = LocalPipeline.from_source(open_model(tiny_llama[0]), 1)
    with pytest.raises(ContextOverflow, match="context is 512"):
        generate(pipe, list(range(600)), 4)
    with pytest.raises(ContextOverflow, match="exceeds the context"):
        generate(pipe, list(range(500)), 50)


def test_cli_prints_one_clear_line_and_exits_1(tmp_path):
    res = subprocess.run([sys.executable, "-m", "meshd", "generate", "--prompt", "hi",
                          "--model", str(tmp_path / "missing")], capture_output=True, text=True)
    assert res.returncode == 1
    assert "meshd: error: model not found" in res.stderr
    assert "Traceback" not in res.stderr


def test_the_loader_without_a_cache_dir_matches_meshds_cached_open(real_source, tmp_path, monkeypatch):
    """meshd passes its cache dir (under $MESHD_HOME); the bare loader recomputes and writes nothing."""
    monkeypatch.chdir(tmp_path)
    bare = open_model(real_source.path)
    assert bare.identity == real_source.identity
    text = "Hello, mesh!"
    assert bare.tokenizer.encode(text) == real_source.tokenizer.encode(text)
    assert list(tmp_path.iterdir()) == []
    assert real_source._cache_root == model_store.tokenizers_dir()
