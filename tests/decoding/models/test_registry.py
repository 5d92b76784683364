"""The family registry (decoding/models/__init__.py): a file's architecture picks the family that runs it,
and an architecture no family runs is refused in one line that names it and what is supported."""

import json
import shutil

import numpy as np
import pytest

from decoding import models
from decoding.errors import UnsupportedArchitecture
from decoding.loader import open_model
from decoding.pipeline_local import LocalPipeline
from tests.support.gguf_convert import write_gguf
from tests.support.tiny_archs import build_model, save_hf_dir

SUPPORTED = "supported: llama, mistral, qwen2, qwen3"


def test_each_architecture_has_one_family():
    assert models.SUPPORTED_ARCHS == ("llama", "mistral", "qwen2", "qwen3")
    assert models.family("qwen3") is models.qwen3
    assert {models.family(a) for a in ("llama", "mistral", "qwen2")} == {models.llama}
    assert models.hf_family("qwen3") == ("qwen3", models.qwen3)
    assert models.hf_family("llama") == ("llama", models.llama)
    assert models.family("gemma3") is None and models.hf_family("gemma3") is None
    assert all(issubclass(f.StageModel, models.StageModel) for f in models.FAMILIES)


@pytest.mark.parametrize("kind,family", [("qwen3", "qwen3"), ("llama3", "llama")])
def test_a_gguf_is_run_by_the_family_its_general_architecture_names(tmp_path, kind, family):
    model = build_model(kind, num_hidden_layers=2)
    src = open_model(write_gguf(model, tmp_path / f"{kind}.gguf"))
    assert src.arch == src.config.arch == model.config.model_type
    assert type(src.load_stage(0, 2)) is getattr(models, family).StageModel


def _gemma3_gguf(path):
    """The head of a Gemma 3 GGUF: its architecture, its hyperparameters, a few of its tensors."""
    import gguf

    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(1)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_tensor("token_embd.weight", np.zeros((300, 64), dtype=np.float32))
    w.add_tensor("blk.0.post_attention_norm.weight", np.ones(64, dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_an_unsupported_gguf_architecture_is_named_in_one_line(tmp_path):
    src = open_model(_gemma3_gguf(tmp_path / "gemma-3-1b-it-Q4_K_M.gguf"))  # opening it reads only the header
    assert src.arch == "gemma3"
    with pytest.raises(UnsupportedArchitecture) as err:
        src.config
    assert str(err.value) == (f"{tmp_path / 'gemma-3-1b-it-Q4_K_M.gguf'}: architecture 'gemma3' is not supported "
                              f"({SUPPORTED})")
    with pytest.raises(UnsupportedArchitecture, match="architecture 'gemma3' is not supported"):
        LocalPipeline.from_source(src, 1)  # loading a stage says the same, before any tensor is read


def test_an_unsupported_model_type_in_a_directory_is_named_in_one_line(tmp_path):
    d = tmp_path / "gemma3-dir"
    shutil.copytree(save_hf_dir(build_model("qwen3", num_hidden_layers=1), tmp_path / "qwen3"), d)
    raw = json.loads((d / "config.json").read_text())
    raw["model_type"] = "gemma3_text"
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedArchitecture, match=rf"gemma3-dir: model_type 'gemma3_text' is not supported "
                                                      rf"\({SUPPORTED}\)$"):
        open_model(d).config
