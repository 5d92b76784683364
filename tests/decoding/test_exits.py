"""Early exits (Synera) in the stage runtime: exit heads, the exit rule, and KV that stays complete.

Mechanism tests use untrained heads (the adapter starts as the identity, so an exit reads the
model's own final norm and LM head at that layer) with a low threshold, so that many tokens
leave early; what a trained file gives is measured in bench/early_exit.py.
"""

from __future__ import annotations

import pytest
import torch

from decoding.batch import BatchItem
from decoding.errors import DrafterError
from decoding.exits.bound import BoundExits, ExitCheck
from decoding.exits.heads import ExitHeads, default_exit_layers, first_exit_layer, preview_exit_layers



@pytest.fixture(scope="module")
def full(real_source):
    return real_source.load_stage(0, real_source.config.num_layers, torch.float32)


@pytest.fixture(scope="module")
def heads(real_source):
    cfg = real_source.config
    torch.manual_seed(0)
    # the 4096 lowest ids hold English's common word pieces in this vocabulary; "other" for the rest
    return ExitHeads(default_exit_layers(cfg.num_layers), cfg.hidden_size, torch.arange(4096),
                     num_layers=cfg.num_layers, vocab_size=cfg.vocab_size)


@pytest.fixture(scope="module")
def prompt(real_source):
    return real_source.tokenizer.apply_chat([{"role": "user", "content": "List the days of the week."}])


def greedy(stage, prompt, n, threshold=0.0, seq="s"):
    """Greedy decoding one step at a time; returns (tokens, exit layers, kv)."""
    kv = stage.new_cache()
    kv.create(seq, len(prompt) + n + 1)
    out = stage.forward(kv, seq, torch.tensor(prompt), all_logits=False)
    tokens, layers = [], []
    for _ in range(n):
        if isinstance(out, ExitCheck):
            tokens.append(int(out.logits.argmax()))
            layers.append(out.layer)
        else:
            tokens.append(int(out[-1].argmax()))
            layers.append(0)
        out = stage.forward_batch(kv, [BatchItem(seq, torch.tensor([tokens[-1]]), all_logits=False,
                                                 exit_threshold=threshold)])[0]
    stage.fill_pending(kv)
    return tokens, layers, kv


def test_exits_sit_in_the_last_quarter_of_the_model_and_never_after_its_last_layer():
    assert first_exit_layer(30) == 23 and default_exit_layers(30) == [23, 26, 29]
    assert default_exit_layers(24, 2) == [18, 23] and default_exit_layers(28) == [21, 24, 27]
    with pytest.raises(ValueError, match="before the last"):
        ExitHeads([30], 8, torch.arange(4), num_layers=30, vocab_size=16)
    with pytest.raises(ValueError, match="after a layer"):
        ExitHeads([0, 3], 8, torch.arange(4), num_layers=30, vocab_size=16)


def test_a_verifiers_preview_exits_sit_from_the_middle_on_and_a_home_stage_refuses_them(real_source):
    assert preview_exit_layers(28) == [11, 15, 20, 24] and preview_exit_layers(30) == [12, 17, 21, 26]
    cfg = real_source.config
    early = ExitHeads([12, 20], cfg.hidden_size, torch.arange(8), num_layers=cfg.num_layers,
                      vocab_size=cfg.vocab_size)
    with pytest.raises(DrafterError, match="preview heads"):
        BoundExits(early, real_source.load_stage(0, cfg.num_layers, torch.float32))


def test_a_stage_without_an_exit_layer_binds_none(real_source, heads):
    front = real_source.load_stage(0, 15, torch.float32)
    with pytest.raises(DrafterError, match="last stage"):
        BoundExits(heads, front)
    back = real_source.load_stage(15, real_source.config.num_layers, torch.float32)
    assert BoundExits(heads, back).layers == [23, 26, 29]
    tail = real_source.load_stage(29, real_source.config.num_layers, torch.float32)
    assert BoundExits(heads, tail).layers == []  # an exit after layer 29 is checked by the stage holding it


def test_exits_off_give_the_full_models_logits_bit_for_bit(real_source, full, heads, prompt):
    want, _, _ = greedy(full, prompt, 12)
    full.exits = BoundExits(heads, full)
    try:
        got, layers, _ = greedy(full, prompt, 12, threshold=0.0)
    finally:
        full.exits = None
    assert got == want and layers == [0] * 12


def test_an_exited_token_leaves_the_same_kv_as_the_full_model_at_every_layer(real_source, full, heads, prompt):
    """The layers a token skipped are computed right after from the state it left with, so the cache a
    later token attends to is the one the full model would have written for the same tokens."""
    full.exits = BoundExits(heads, full)
    try:
        tokens, layers, kv = greedy(full, prompt, 24, threshold=0.4)
    finally:
        full.exits = None
    assert {0, 23} <= set(layers) <= {0, 23, 26, 29} and len(set(layers)) >= 3  # full depth and exits
    ref = full.new_cache()
    ref.create("r", len(prompt) + 26)
    full.forward(ref, "r", torch.tensor(prompt), all_logits=False)
    for t in tokens:
        full.forward(ref, "r", torch.tensor([t]), all_logits=False)
    n = len(prompt) + len(tokens)
    assert kv.length("s") == ref.length("r") == n
    for layer in range(real_source.config.num_layers):
        (k, v), = kv.segments("s", layer, n)
        (rk, rv), = ref.segments("r", layer, n)
        assert torch.equal(k, rk) and torch.equal(v, rv), f"layer {layer} differs"


def test_a_token_that_stays_gets_exactly_the_full_models_logits_after_earlier_exits(full, heads, prompt):
    full.exits = BoundExits(heads, full)
    try:
        tokens, layers, _ = greedy(full, prompt, 24, threshold=0.4)
    finally:
        full.exits = None
    stayed = [i for i, l in enumerate(layers) if l == 0 and i > 0 and any(layers[:i])]
    assert stayed, "no full-depth token after an exit in this answer"
    i = stayed[0]
    kv = full.new_cache()
    kv.create("r", len(prompt) + i + 1)
    out = full.forward(kv, "r", torch.tensor(prompt + tokens[:i]), all_logits=False)
    assert int(out[-1].argmax()) == tokens[i]


def test_the_exit_token_is_the_exit_heads_choice_and_clears_the_margin(full, heads, prompt):
    bound = BoundExits(heads, full)
    full.exits = bound
    try:
        kv, out = exited_once(full, prompt)
        full.fill_pending(kv)
    finally:
        full.exits = None
    assert isinstance(out, ExitCheck) and out.layer == 23 and out.margin >= 1e-6
    finite = torch.isfinite(out.logits).nonzero().flatten()
    assert set(finite.tolist()) <= set(range(4096)) and int(out.logits.argmax()) < 4096


def test_in_a_batch_one_sequence_may_exit_while_another_goes_on_unchanged(full, heads, prompt):
    alone, _, _ = greedy(full, prompt, 6)
    full.exits = BoundExits(heads, full)
    try:
        kv = full.new_cache()
        for s in ("a", "b"):
            kv.create(s, len(prompt) + 8)
        la = full.forward(kv, "a", torch.tensor(prompt), all_logits=False)
        lb = full.forward(kv, "b", torch.tensor(prompt), all_logits=False)
        ta, tb = [int(la[-1].argmax())], [int(lb[-1].argmax())]
        exits = 0
        for _ in range(5):
            out_a, out_b = full.forward_batch(kv, [
                BatchItem("a", torch.tensor([ta[-1]]), all_logits=False, exit_threshold=0.05),
                BatchItem("b", torch.tensor([tb[-1]]), all_logits=False)])
            exits += isinstance(out_a, ExitCheck)
            ta.append(int(out_a.logits.argmax()) if isinstance(out_a, ExitCheck) else int(out_a[-1].argmax()))
            tb.append(int(out_b[-1].argmax()))
        full.fill_pending(kv)
    finally:
        full.exits = None
    assert exits and tb == alone


def exited_once(stage, prompt):
    """A cache holding ``prompt`` and one decode step whose token left at the first exit (its fill owed)."""
    kv = stage.new_cache()
    kv.create("s", len(prompt) + 3)
    stage.forward(kv, "s", torch.tensor(prompt), all_logits=False)
    out = stage.forward_batch(kv, [BatchItem("s", torch.tensor([504]), all_logits=False, exit_threshold=1e-6)])[0]
    assert isinstance(out, ExitCheck) and stage.has_pending()
    return kv, out


def test_a_sequence_freed_before_its_fill_owes_nothing(full, heads, prompt):
    full.exits = BoundExits(heads, full)
    try:
        kv, _ = exited_once(full, prompt)
        kv.free("s")
        assert full.fill_pending(kv) == [] and not full.has_pending()
    finally:
        full.exits = None


def test_a_fill_that_fails_names_its_sequence_and_the_next_step_refuses_to_read_a_partial_cache(
        full, heads, prompt, monkeypatch):
    full.exits = BoundExits(heads, full)
    try:
        kv, _ = exited_once(full, prompt)
        with monkeypatch.context() as m:
            m.setattr(full, "_layer", lambda *a, **k: (_ for _ in ()).throw(MemoryError("no room")))
            with pytest.raises(RuntimeError, match="early exit skipped"):
                full.forward_batch(kv, [BatchItem("s", torch.tensor([11]), all_logits=False)])
    finally:
        full.exits = None


def test_prompts_trees_and_probes_never_exit(full, heads, prompt):
    it = BatchItem("s", torch.tensor(prompt), all_logits=False, exit_threshold=0.5)
    assert not it.may_exit  # a prompt chunk
    assert not BatchItem("s", torch.tensor([1]), all_logits=True, exit_threshold=0.5).may_exit  # a verify round
    assert not BatchItem("s", torch.tensor([1]), attention_tail=8, all_logits=False, exit_threshold=0.5).may_exit
    assert BatchItem("s", torch.tensor([1]), all_logits=False, exit_threshold=0.5).may_exit


# -- the file ---------------------------------------------------------------------------------------------
def test_a_heads_file_round_trips_and_loads_only_with_its_hash(tmp_path, heads):
    path = tmp_path / "exits.pt"
    with torch.no_grad():
        heads.w.normal_(0, 0.01)
    try:
        sha = heads.save(path, {"model": {"identity": "m"}})
        back = ExitHeads.load(path, sha256=sha, num_layers=heads.num_layers, hidden_size=heads.hidden_size,
                              vocab_size=heads.vocab_size)
        assert back.layers == heads.layers and torch.equal(back.shortlist, heads.shortlist)
        assert torch.allclose(back.w, heads.w.to(torch.float16).float())
        with pytest.raises(DrafterError, match="sha256 mismatch"):
            ExitHeads.load(path, sha256="0" * 64)
        with pytest.raises(DrafterError, match="heads belong to one model"):
            ExitHeads.load(path, hidden_size=heads.hidden_size + 1)
        path.write_bytes(b"not a heads file")
        with pytest.raises(DrafterError, match="not a readable exit heads file"):
            ExitHeads.load(path)
    finally:
        with torch.no_grad():
            heads.w.zero_()


def test_the_shipped_exit_heads_load_for_the_embedded_model_only(real_source):
    from meshd.model.heads import EXITS_FILE, EXITS_SHA256, embedded_exits

    cfg = real_source.config
    heads = embedded_exits(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                           model_identity=real_source.identity)
    assert heads.layers == default_exit_layers(cfg.num_layers) and len(EXITS_SHA256) == 64
    assert heads.meta["model"]["identity"] == real_source.identity and EXITS_FILE.is_file()
    with pytest.raises(DrafterError, match="trained for"):
        embedded_exits(model_identity="another-model")
