"""A lazy LM head (decoding.head_rows): rows computed when read, over a grammar's tokens, with the full head's bits."""

from __future__ import annotations

import pytest
import torch

from decoding.head_rows import HeadRows
from decoding.pipeline_local import LocalPipeline


def test_a_row_over_the_allowed_tokens_has_the_full_products_bits_there_and_minus_inf_elsewhere(real_source):
    stage = LocalPipeline.from_source(real_source, 1, packed="gguf").stages[0]
    assert stage.selectable_head
    vocab = real_source.config.vocab_size
    normed = torch.randn(3, real_source.config.hidden_size)
    full = stage.lm_head(normed).float()
    rows = HeadRows(normed, stage.lm_head, vocab)
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[torch.randperm(vocab)[:300]] = True
    got = rows.row(1, allowed)
    assert torch.equal(got[allowed], full[1][allowed]) and bool(torch.isneginf(got[~allowed]).all())
    assert (rows.products, rows.selected) == (1, 1)  # only row 1, only its 300 tokens
    assert torch.equal(rows[2], full[2]) and torch.equal(rows[-1], full[2])  # no mask: the whole row
    assert rows.products == 4  # rows 0, 1 and 2 in one product, the first time one was read whole
    everything = torch.ones(vocab, dtype=torch.bool)
    assert torch.equal(rows.row(0, everything), full[0]) and rows.products == 4  # many allowed: the plain row
    with pytest.raises(IndexError):
        rows.row(3)


def test_heads_the_kernels_cannot_select_from_are_computed_in_the_pass(real_source):
    stage = LocalPipeline.from_source(real_source, 1).stages[0]  # float32: torch's product, not row-exact
    assert not stage.selectable_head
