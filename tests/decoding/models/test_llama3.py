"""Llama 3.x through the Llama family (decoding/models/llama): its ``llama3`` RoPE frequency scaling and
the tied head of 3.2 1B/3B, against transformers, from a Hugging Face directory and from GGUF, on one
device and across a 2-stage mesh, in every numeric mode.

A Hugging Face directory names the scaling in config.json; a GGUF carries it the
way llama.cpp's converter writes it, as a ``rope_freqs`` tensor of divisors (its
metadata has no ``llama3`` scaling type). Both must give transformers' logits.
"""

import json
import shutil

import pytest
import torch

from decoding.loader import open_model
from tests.support.parity import MODES, SOURCES, TOLERANCE, TinyFiles, assert_equals_transformers, meshd_logits, token_ids
from tests.support.tiny_archs import LLAMA3_ROPE, build_model

KINDS = ("llama3", "llama3-tied")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return {kind: TinyFiles.write(kind, tmp_path_factory.mktemp(kind)) for kind in KINDS}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("kind", KINDS)
def test_logits_equal_transformers_on_one_device_and_two_stages(tiny, kind, source, mode):
    assert_equals_transformers(tiny[kind], source, mode)


def test_the_scaling_matters_to_these_logits(tiny):
    """Guard on the model, not on meshd: the same weights with plain RoPE move the logits by far more
    than float32's and float16's tolerances (about as much as bfloat16's), so the float32 and float16
    equalities above, which every source and layout gets, would see the scaling dropped or misread."""
    scaled = tiny["llama3"].model
    plain = build_model("llama3", rope_scaling=None)
    plain.load_state_dict(scaled.state_dict())
    ids = torch.tensor([token_ids(scaled.config.vocab_size)])
    with torch.no_grad():
        moved = (plain(ids).logits - scaled(ids).logits).abs().max().item()
    assert moved > 100 * TOLERANCE["float32"] and moved > 2 * TOLERANCE["float16"]


def test_a_directory_reads_its_scaling_and_a_gguf_its_frequency_divisors_to_the_same_frequencies(tiny):
    hf, gguf = open_model(tiny["llama3"].paths["hf"]), open_model(tiny["llama3"].paths["F16"])
    assert hf.config.rope_scaling == LLAMA3_ROPE
    assert gguf.config.rope_scaling is None and gguf.has_tensor("rope_freqs")
    from_dir, from_gguf = hf.load_stage(0, 1).inv_freq, gguf.load_stage(2, 3).inv_freq
    torch.testing.assert_close(from_gguf, from_dir, rtol=1e-6, atol=0)
    plain = 1.0 / (10_000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    assert (from_dir < plain * 0.99).sum() >= 4  # the slow half of the frequencies is scaled down


def test_a_config_in_the_hubs_spelling_reads_the_same(tiny, tmp_path):
    """Llama 3.2's config.json on the Hub says ``rope_scaling`` and ``rope_theta`` (transformers 4);
    transformers 5 saves one ``rope_parameters``. Either gives the same config and the same logits."""
    d = tmp_path / "hub-spelling"
    shutil.copytree(tiny["llama3"].paths["hf"], d)
    raw = json.loads((d / "config.json").read_text())
    params = raw.pop("rope_parameters")
    raw["rope_theta"] = params.pop("rope_theta")
    raw["rope_scaling"] = params
    (d / "config.json").write_text(json.dumps(raw))
    new, hub = open_model(tiny["llama3"].paths["hf"]), open_model(d)
    assert hub.config.rope_scaling == new.config.rope_scaling == LLAMA3_ROPE
    assert hub.config.rope_theta == new.config.rope_theta == 10_000.0
    ids = token_ids(hub.config.vocab_size)
    torch.testing.assert_close(meshd_logits(d, "float32", 1, ids), meshd_logits(new.path, "float32", 1, ids))


@pytest.mark.parametrize("source", ["hf", "F16"])
def test_the_32_b_sizes_tie_the_head_and_3_1_does_not(tiny, source):
    tied, untied = open_model(tiny["llama3-tied"].paths[source]), open_model(tiny["llama3"].paths[source])
    assert tied.config.tie_embeddings and not tied.has_tensor("lm_head")
    assert not untied.config.tie_embeddings and untied.has_tensor("lm_head")
    stage = tied.load_stage(0, 3)
    assert stage.lm_head is stage.embed  # one matrix, as in the file
    assert tied.config.arch == untied.config.arch == "llama"
    assert not tied.config.attention_bias
