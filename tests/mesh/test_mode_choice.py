"""--weights auto on a CPU: the device times its exact modes once and serves in the fastest."""

import json
from types import SimpleNamespace

import pytest

from meshd.model import mode_choice as mc


def fake_timer(times: dict[str, tuple[float, float]], calls: list | None = None):
    def timer(source, mode, threads=1):
        if calls is not None:
            calls.append(mode)
        decode, prefill = times[mode]
        return mc.ModeTiming(mode, decode, prefill)
    return timer


def test_the_mode_with_the_cheapest_typical_request_wins_not_the_fastest_decode(monkeypatch):
    import decoding.device as dv

    monkeypatch.setattr(dv, "mode_available", lambda mode: (True, ""))
    # packed decodes a little faster but prefills four times slower: a home request is mostly prompt
    times = {"gguf": (0.010, 0.10), "packed": (0.009, 0.40), "float32": (0.030, 0.08)}
    choice = mc.choose(None, timer=fake_timer(times))
    assert choice.mode == "gguf" and choice.how == "measured"
    assert [t.mode for t in choice.timings] == list(mc.CANDIDATES)
    line = choice.describe()
    assert line.startswith("gguf (measured: request time per layer gguf 1.00x") and "packed" in line


def test_modes_this_cpu_lacks_are_skipped_with_the_reason(monkeypatch):
    import decoding.device as dv

    monkeypatch.setattr(dv, "mode_available", lambda mode: (mode != "packed", "int4 kernel unavailable (test)"))
    calls: list = []
    choice = mc.choose(None, timer=fake_timer({"gguf": (0.02, 0.2), "float32": (0.01, 0.1)}, calls))
    assert calls == ["gguf", "float32"] and choice.mode == "float32"
    assert choice.skipped == {"packed": "int4 kernel unavailable (test)"}


def test_a_mode_that_fails_while_timed_is_not_served_in(monkeypatch):
    import decoding.device as dv

    monkeypatch.setattr(dv, "mode_available", lambda mode: (True, ""))

    def timer(source, mode, threads=1):
        if mode == "gguf":
            raise RuntimeError("kernel crashed")
        return mc.ModeTiming(mode, 0.01, 0.1)

    choice = mc.choose(None, timer=timer)
    assert choice.mode in ("packed", "float32") and "kernel crashed" in choice.skipped["gguf"]


def test_the_choice_is_kept_per_model_and_cpu_and_reused(tmp_path, monkeypatch):
    state = SimpleNamespace(root=tmp_path)
    source = SimpleNamespace(identity="model-a@1234")
    measured: list = []

    def chooser(src, threads=1):
        measured.append(src.identity)
        return mc.ModeChoice("gguf", "measured", (mc.ModeTiming("gguf", 0.01, 0.1), mc.ModeTiming("float32", 0.03, 0.1)))

    first = mc.settle(state, source, chooser=chooser)
    again = mc.settle(state, source, chooser=chooser)
    assert first.mode == again.mode == "gguf" and again.how == "reused" and measured == ["model-a@1234"]
    assert again.timings == first.timings
    mc.settle(state, SimpleNamespace(identity="model-b@5678"), chooser=chooser)  # another model: measured
    assert measured == ["model-a@1234", "model-b@5678"]
    kept = json.loads((tmp_path / mc.CHOICE_FILE).read_text())
    assert len(kept) == 2 and all(v["mode"] == "gguf" for v in kept.values())


def test_a_corrupt_choice_file_is_measured_over(tmp_path):
    (tmp_path / mc.CHOICE_FILE).write_text("{not json")
    choice = mc.settle(SimpleNamespace(root=tmp_path), SimpleNamespace(identity="m@1"),
                       chooser=lambda s, t=1: mc.ModeChoice("float32", "measured", (mc.ModeTiming("float32", 1, 1),)))
    assert choice.how == "measured"
    assert json.loads((tmp_path / mc.CHOICE_FILE).read_text())


@pytest.mark.parametrize("mode", ["gguf", "float32"])
def test_one_layer_of_the_embedded_model_is_timed_in_a_mode(real_source, mode):
    import decoding.device as dv

    if not dv.mode_available(mode)[0]:
        pytest.skip(f"{mode} is not available here")
    timing = mc.time_mode(real_source, mode, repeats=2)
    assert timing.mode == mode and timing.decode_s > 0 and timing.prefill_s > 0


def test_a_kept_choice_this_machine_can_no_longer_compute_is_measured_again(tmp_path, monkeypatch):
    """Kernels gone after an upgrade (no compiler): the kept "gguf" must not fail the model's load."""
    import decoding.device as dv

    state, source = SimpleNamespace(root=tmp_path), SimpleNamespace(identity="m@1")
    keep = lambda s, t=1: mc.ModeChoice("gguf", "measured", (mc.ModeTiming("gguf", 0.01, 0.1),))  # noqa: E731
    mc.settle(state, source, chooser=keep)
    monkeypatch.setattr(dv, "mode_available", lambda mode: (mode != "gguf", "no compiler"))
    again = mc.settle(state, source, chooser=lambda s, t=1: mc.ModeChoice(
        "float32", "measured", (mc.ModeTiming("float32", 0.02, 0.1),)))
    assert again.mode == "float32" and again.how == "measured"


def test_a_profile_of_another_mode_is_planned_with_this_modes_kv_cache():
    """The gguf mode has no shipped profile of the Qwen models: their packed ones plan it, with the
    KV cache and activations a gguf stage holds (float32: twice packed's bfloat16)."""
    from meshd.model.profile_files import as_mode

    packed = {"dtype": "packed", "kv_bytes_per_token_per_layer": 1024, "layer_latency_s": [[0.1]]}
    gguf = as_mode(packed, "gguf")
    assert gguf["dtype"] == "gguf" and gguf["kv_bytes_per_token_per_layer"] == 2048
    assert gguf["layer_latency_s"] == packed["layer_latency_s"] and gguf["planned_as"]["measured_in"] == "packed"
    assert as_mode(packed, "packed") is packed and as_mode(None, "gguf") is None and as_mode(packed, "") is packed
