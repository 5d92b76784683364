"""``meshd generate --speculative``: the single-device speculative path prints the reference's tokens."""

import json

import pytest

from meshd.cli import main

pytestmark = pytest.mark.slow

PROMPT = "Repeat after me: the kitchen light is on, the kitchen light is off, the kitchen light is on."


def _run(capsys, *extra):
    assert main(["generate", "--prompt", PROMPT, "--max-tokens", "32", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_every_drafter_prints_the_reference_tokens(real_source, capsys):
    ref = _run(capsys)
    assert ref["speculative"] is None
    for drafter in ("lookup", "auto"):
        got = _run(capsys, "--speculative", drafter)
        assert got["token_ids"] == ref["token_ids"]
        assert got["speculative"]["drafter"] in ("lookup", "auto")


def test_a_draft_model_sharing_the_tokenizer_drafts_and_changes_nothing(real_source, capsys):
    ref = _run(capsys)
    got = _run(capsys, "--speculative", "draft_model", "--draft-model", str(real_source.path),
               "--max-candidates", "4")
    assert got["token_ids"] == ref["token_ids"]
    assert got["speculative"]["accepted"] == got["speculative"]["drafted"] > 0  # the target drafting itself


def test_a_missing_heads_file_is_a_clear_error_for_medusa_and_a_fallback_for_auto(real_source, capsys, tmp_path):
    missing = str(tmp_path / "nope.pt")
    assert main(["generate", "--prompt", PROMPT, "--max-tokens", "8", "--speculative", "medusa",
                 "--heads", missing]) == 1
    assert "nope.pt" in capsys.readouterr().err
    ref = _run(capsys)
    got = _run(capsys, "--speculative", "auto", "--heads", missing)
    assert got["token_ids"] == ref["token_ids"]
    assert "nope.pt" in got["speculative"]["fallback_reason"]
