"""What a pass's item asks of the last stage's head, from the message and the sequence's sampling state."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from decoding.penalties import Penalties
from decoding.sampling import SamplingParams, SamplingSpec
from decoding.selector import TokenSelector
from meshd.pipeline.stage.slot import SeqSlot
from meshd.pipeline.stage.worker import StageWorker
from transport.stage_messages import StageForward


def item_for(selector: TokenSelector | None = None, **kw):
    worker = StageWorker(source=None)
    worker.stage = SimpleNamespace(is_last=True)
    try:
        msg = StageForward(request_id="r", plan_version=1, seq_id="s", position_offset=8,
                           **{"token_ids": torch.tensor([5]), **kw})
        return worker.work_for(msg, SeqSlot("s", 0.0, selector=selector), msg.token_ids, None).item
    finally:
        worker.close()


def test_a_plain_greedy_step_asks_only_for_its_best_token():
    """A tensor group then gathers each member's best instead of its share of a 150k-token row."""
    assert item_for().best_only
    assert item_for(TokenSelector(SamplingParams())).best_only
    assert item_for(exit_threshold=0.5).best_only  # (a group takes no early exit; one device ignores it)


@pytest.mark.parametrize("why, kw, selector", [
    ("a draw from the distribution", {"sampling": SamplingSpec(SamplingParams(temperature=0.7))}, None),
    ("the sequence's own draw", {}, TokenSelector(SamplingParams(temperature=0.7, seed=1))),
    ("penalties move the row", {}, TokenSelector(SamplingParams(), penalties=Penalties(repeat=1.2))),
    ("a verifier reads the top-k", {"return_topk": 8}, None),
    ("Medusa drafts from the normed row", {"medusa_paths": 2}, None),
    ("a prompt chunk before the last reads no row", {"is_last_chunk": False}, None),
])
def test_a_step_whose_row_is_read_beyond_its_argmax_gathers_whole_rows(why, kw, selector):
    assert not item_for(selector, **kw).best_only, why


def test_a_verify_round_reads_its_rows_whole():
    item = item_for(token_ids=torch.tensor([5, 6, 7]), verify=True)
    assert not item.best_only and item.all_logits
