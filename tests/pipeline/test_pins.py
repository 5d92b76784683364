"""Pinned prompts: an operator's files become the token ids every matching request starts with."""

from __future__ import annotations

import json

import pytest

from meshd.config import ConfigError
from meshd.pipeline.pins import pinned_prefixes


def test_a_json_chat_request_pins_what_every_request_with_that_system_prompt_starts_with(real_source, tmp_path):
    tok = real_source.tokenizer
    system = [{"role": "system", "content": "You are a voice assistant for Home Assistant."}]
    path = tmp_path / "ha.json"
    path.write_text(json.dumps({"messages": system}))
    (pinned,) = pinned_prefixes([str(path)], tok)
    request = tok.apply_chat(system + [{"role": "user", "content": "Turn on the kitchen light."}])
    assert request[:len(pinned)] == pinned and len(pinned) > 5


def test_a_text_file_is_pinned_as_it_is(real_source, tmp_path):
    path = tmp_path / "prompt.txt"
    path.write_text("<|im_start|>system\nYou are helpful.<|im_end|>\n")
    assert pinned_prefixes([str(path)], real_source.tokenizer) == [real_source.tokenizer.encode(
        path.read_text(), add_bos=False)]


@pytest.mark.parametrize("content,error", [(None, "cannot read"), ("{not json", "not valid JSON"),
                                           ('{"messages": []}', "messages")])
def test_a_pin_file_that_cannot_be_used_is_a_clear_config_error(real_source, tmp_path, content, error):
    path = tmp_path / "pin.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=error):
        pinned_prefixes([str(path)], real_source.tokenizer)
