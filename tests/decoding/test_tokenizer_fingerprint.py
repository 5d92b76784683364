"""A tokenizer's fingerprint (which vocabularies mean the same ids) is computed once per cached tokenizer."""

from __future__ import annotations

import json
import shutil

from decoding.loader.tokenizer import FINGERPRINT_FILE, load_cache, vocabulary_fingerprint
from decoding.speculative.draft_model import tokenizer_fingerprint
from meshd.model import store


def _cached_copy(tmp_path):
    src = store.open_model(None).tokenizer  # the embedded model's cached tokenizer
    d = tmp_path / "tok"
    d.mkdir()
    for name in ("tokenizer.json", "tokenizer_meta.json"):
        shutil.copy(src.path.parent / name, d / name)
    return d


def test_the_kept_fingerprint_is_the_computed_one_and_is_read_back(tmp_path):
    d = _cached_copy(tmp_path)
    tok = load_cache(d)
    assert tokenizer_fingerprint(tok) == vocabulary_fingerprint(tok)
    kept = json.loads((d / FINGERPRINT_FILE).read_text())
    assert kept["fingerprint"] == vocabulary_fingerprint(tok)
    # a restart reads it (a planted value shows it was not computed again)
    (d / FINGERPRINT_FILE).write_text(json.dumps({**kept, "fingerprint": "planted"}))
    assert load_cache(d).fingerprint == "planted"


def test_a_changed_vocabulary_is_fingerprinted_again(tmp_path):
    d = _cached_copy(tmp_path)
    before = load_cache(d).fingerprint
    data = json.loads((d / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (d / "tokenizer.json").write_text(json.dumps(data))
    after = load_cache(d)
    assert after.fingerprint != before
    assert after.fingerprint == vocabulary_fingerprint(after)


def test_a_tokenizer_outside_meshds_cache_leaves_its_folder_alone(tmp_path):
    d = _cached_copy(tmp_path)
    from decoding.loader.tokenizer import Tokenizer

    tok = load_cache(d)
    outside = Tokenizer(tok.path, tok.meta)
    assert outside.fingerprint == tok.fingerprint
    (d / FINGERPRINT_FILE).unlink()
    assert Tokenizer(tok.path, tok.meta).fingerprint == tok.fingerprint
    assert not (d / FINGERPRINT_FILE).exists()
