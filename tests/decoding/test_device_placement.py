"""A stage computes on one device, and nothing in its forward falls back to the CPU by accident.

CI has no GPU, so the CUDA bugs of issue #14 (positions from ``torch.arange``,
KV buffers from ``torch.empty``, masks, RoPE, sampling's ``searchsorted`` on two
devices) are caught here in two ways that need none:

- every tensor factory called while the runtime prefills, decodes, verifies a
  token tree, forks, batches and samples is recorded by a ``TorchFunctionMode``;
  a call without ``device=`` lands on the CPU whatever the stage's device, so
  there must be none (and on the CPU path no host/device move either);
- a stage placed on the ``meta`` device runs the same forwards. Like CUDA, meta
  refuses to mix with CPU tensors ("Tensor on device cpu is not on the expected
  device meta"), so any tensor the forward makes on the wrong device fails it.

Plus the rules that turn ``--device`` / ``--dtype`` into a device, with their
one-line errors, checked with CUDA's answers faked (``auto`` is the CPU here).
"""

from __future__ import annotations

import os
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode

from decoding import device as dv
from decoding.errors import DeviceError
from decoding.generate import generate
from decoding.loader import open_model
from decoding.medusa import MedusaHeads
from decoding.pipeline_local import LocalPipeline
from decoding.penalties import Penalties
from decoding.sampling import Sampler, SamplingParams
from decoding.selector import TokenSelector
from decoding.speculative.generate import MedusaSource, speculative_generate
from decoding.speculative.tree import DraftTree
from decoding.speculative.verify import verify_sampled
from decoding.batch import BatchItem
from decoding.models import StageModel
from tests.support.repo import ROOT as REPO_ROOT

# Functions that create a tensor from nothing: without device= they make it on the CPU.
# (``*_like`` and ``Tensor.new_*`` inherit their input's device and are not listed.)
FACTORIES = {
    torch.arange, torch.empty, torch.zeros, torch.ones, torch.full, torch.tensor, torch.rand, torch.randn,
    torch.randint, torch.randperm, torch.eye, torch.linspace, torch.logspace, torch.tril_indices,
    torch.triu_indices, torch.empty_strided, torch.scalar_tensor, torch.as_tensor,
}
MOVES = {torch.Tensor.cpu, torch.Tensor.cuda}
ROOT = str(REPO_ROOT)
RUNTIME = os.path.join(ROOT, "decoding") + os.sep
TESTS = os.path.join(ROOT, "tests") + os.sep
REPO = tuple(os.path.join(ROOT, d) + os.sep for d in ("decoding", "meshd", "partition", "transport", "tests"))


def _caller(runtime: tuple[str, ...]) -> str | None:
    """Where the call was made, if the innermost of this repository's frames is the runtime's (else
    None: a test making its inputs, which are host data like a message off the network)."""
    for frame in reversed(traceback.extract_stack()[:-2]):  # not _caller, not __torch_function__
        if frame.filename.startswith(REPO):
            if not frame.filename.startswith(runtime):
                return None
            return f"{os.path.relpath(frame.filename, ROOT)}:{frame.lineno} {frame.line}"
    return None


class PlacementRecorder(TorchFunctionMode):
    """Records factory calls without ``device=`` and host/device moves that the runtime makes.

    Nothing is allow-listed: host-side tensors (sampling's draw, a tree mask built
    from a Python list, RoPE frequencies computed in float64 at load) say
    ``device="cpu"`` where they are made, so each is a visible decision.
    """

    def __init__(self, runtime: tuple[str, ...] = (RUNTIME,)):
        super().__init__()
        self.runtime = runtime
        self.undevised: list[str] = []
        self.moves: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        undevised = func in FACTORIES and kwargs.get("device") is None
        moved = func in MOVES or (func is torch.Tensor.to and _names_device(args[1:], kwargs))
        if undevised or moved:
            where = _caller(self.runtime)
            if where is not None:
                (self.undevised if undevised else self.moves).append(f"{func.__name__} at {where}")
        return func(*args, **kwargs)


def _names_device(args, kwargs) -> bool:
    """Whether a ``Tensor.to`` call names a device (``.to(dtype)`` alone does not move anything)."""
    if "device" in kwargs:
        return True
    return any(isinstance(a, (str, torch.device, torch.Tensor)) for a in args)


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return open_model(tiny_llama[0])


def ids(n, seed=0):
    return torch.randint(0, 211, (n,), generator=torch.Generator().manual_seed(seed))


# -- the recorder itself ----------------------------------------------------------------------------


def test_the_recorder_catches_the_bugs_it_is_for():
    """A recorder that saw nothing would pass everything: with this file taken as "the runtime", it
    sees the issue's patterns, and it sees nothing where the device is named."""
    from decoding.masks import chunk_mask

    with PlacementRecorder(runtime=(TESTS,)) as rec:
        torch.arange(3)  # positions without a device
        torch.empty(2, 3, dtype=torch.float32)  # a KV buffer without a device
        torch.tensor([0.5], dtype=torch.float64)  # sampling's searchsorted operand
        torch.zeros(2, device="cpu")  # named: fine
        chunk_mask(2, 3, "cpu")  # the runtime's own calls, named: fine (and not this file's)
        torch.ones(2, device="cpu").to(torch.float32)  # a dtype cast is no move ...
        torch.ones(2, device="cpu").to("cpu")  # ... a device is
    assert [u.split(" ")[0] for u in rec.undevised] == ["arange", "empty", "tensor"], rec.undevised
    assert all("tests/decoding/test_device_placement.py:" in u for u in rec.undevised)
    assert len(rec.moves) == 1


# -- no tensor is made off the stage's device ------------------------------------------------------


def test_the_cpu_runtime_names_a_device_for_every_tensor_it_makes_and_moves_nothing(tiny):
    """Prefill (chunked), decode, batching, forks, KV growth, a token tree verified and compacted,
    Medusa proposals, attention probes, penalties and seeded sampling, all under the recorder."""
    pipe = LocalPipeline.from_source(tiny, 2)
    heads = MedusaHeads(num_heads=2, hidden_size=tiny.config.hidden_size)  # built outside: parameters init
    medusa = MedusaSource(heads, pipe.stages[-1].lm_head)
    sampled = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=3)
    prompt = ids(23).tolist()
    whole = tiny.load_stage(0, tiny.config.num_layers)  # loading moves weights (once): not the forward path
    with PlacementRecorder() as rec:
        # the reference loop: chunked prefill (past > 0: explicit chunk masks), decode steps, sampling
        generate(pipe, prompt, 6, sampled, chunks=3)
        # speculative rounds with a tree (lookup drafts) and Medusa proposals, then verification and keep()
        speculative_generate(pipe, prompt * 2, 8, sampled, drafter="auto", medusa=medusa, max_candidates=6)
        # a token tree verified by hand: host tree mask, sampled verification, compaction
        pipe.create("t", 4)  # small: the caches must grow inside reserve()
        pipe.prefill("t", prompt)
        tree = DraftTree((5, 6, 7, 8, 9), (-1, 0, 0, 1, 2))
        logits = pipe.forward("t", torch.tensor(tree.tokens, device="cpu"), tree_mask=tree.mask(), all_logits=True)
        verdict = verify_sampled(tree, logits, sampled, Sampler(sampled).uniform)
        pipe.keep("t", len(prompt), list(verdict.path))
        # a forked child reads its parent's prefix in place (segmented attention)
        pipe.fork("t", "child", len(prompt))
        pipe.forward("child", torch.tensor([3, 4], device="cpu"))
        # penalties and the selector on the last logits
        select = TokenSelector(sampled, penalties=Penalties(presence=0.5, frequency=0.3, repeat=1.2),
                               prompt_tail=prompt)
        select(logits[-1])
        select(logits[-2])
        # two sequences in one batched pass, the last one asking for the attention tail (probes)
        kv = whole.new_cache()
        for s in ("a", "b"):
            kv.create(s, 64)
        probes: dict = {}
        whole.forward_batch(kv, [BatchItem("a", ids(9, 1), attention_tail=4), BatchItem("b", ids(5, 2))], probes)
        whole.forward_batch(kv, [BatchItem("a", ids(1, 3), attention_tail=4), BatchItem("b", ids(2, 4))], probes)
    assert rec.undevised == [], "tensors made without a device (they land on the CPU):\n" + "\n".join(rec.undevised)
    assert rec.moves == [], "host/device moves on the CPU path:\n" + "\n".join(rec.moves)


# -- the same forwards on a device that refuses CPU tensors --------------------------------------


def test_a_stage_on_a_device_that_refuses_cpu_tensors_runs_every_kind_of_forward(tiny):
    """``meta`` stands in for CUDA: inputs from the host are moved in, everything else is made there."""
    meta = torch.device("meta")
    stage = StageModel.from_source(tiny, 0, tiny.config.num_layers, torch.float32, meta)
    assert stage.device == meta and stage.inv_freq.device == meta
    assert {t.device for lw in stage.layers for t in (lw.qkv, lw.o, lw.gate_up, lw.down)} == {meta}
    kv = stage.new_cache()
    assert kv.device == meta
    kv.create("s", 8)  # grows below
    vocab = tiny.config.vocab_size
    # host token ids in, device logits out: a causal first chunk, a chunk after it, a decode step
    for n, want in ((11, 11), (6, 6), (1, 1)):
        out = stage.forward(kv, "s", ids(n), all_logits=True)
        assert out.device == meta and tuple(out.shape) == (want, vocab)
    # a token tree with its host mask, the accepted nodes kept (device index)
    tree = DraftTree((5, 6, 7, 8), (-1, 0, 0, 1))
    logits, normed = stage.forward(kv, "s", torch.tensor(tree.tokens), tree_mask=tree.mask(), return_normed=True)
    assert logits.device == normed.device == meta and logits.shape[0] == 4
    kv.keep("s", 18, [0, 1, 3])
    assert kv.length("s") == 21
    # a forked child (segmented attention over the parent's prefix), batched with another sequence
    kv.fork("s", "c", 21)
    kv.create("o", 4)
    probes: dict = {}
    outs = stage.forward_batch(kv, [BatchItem("c", ids(3, 1), attention_tail=4),
                                    BatchItem("o", ids(5, 2), attention_tail=2)], probes)
    assert [o.device for o in outs] == [meta, meta] and probes[0].device == meta
    # a middle stage: host hidden states in
    middle = StageModel.from_source(tiny, 2, 4, torch.float32, meta)
    kv2 = middle.new_cache()
    kv2.create("m", 16)
    h = middle.forward(kv2, "m", torch.randn(7, tiny.config.hidden_size))
    assert h.device == meta and tuple(h.shape) == (7, tiny.config.hidden_size)


def test_a_pipeline_on_the_cpu_hands_out_the_stage_outputs_themselves(tiny):
    """No copy on the CPU path: the pipeline's result is the last stage's own tensor."""
    pipe = LocalPipeline.from_source(tiny, 2)
    assert pipe.devices == [dv.CPU, dv.CPU] and pipe._host_out
    pipe.create("s", 32)
    assert pipe.prefill("s", ids(9).tolist()).device == dv.CPU


def test_seeded_sampling_draws_on_the_host_in_float64(tiny):
    """The draw and the cumulative sum are host float64 whatever the logits' dtype: bfloat16 logits
    (a GPU stage's, say) give the token their float32 copy gives."""
    logits = torch.randn(211, generator=torch.Generator().manual_seed(5)) * 3
    p = SamplingParams(temperature=0.7, top_p=0.95, seed=9)
    a = [Sampler(p)(logits.bfloat16().float()) for _ in range(3)]
    b = [Sampler(p)(logits.bfloat16()) for _ in range(3)]
    assert a == b


# -- --device / --dtype ---------------------------------------------------------------------------


def _fake_cuda(monkeypatch, count=1, capability=(8, 0)):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


def test_auto_is_the_cpu_here_and_cpu_is_always_there():
    want = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else dv.CPU
    assert dv.resolve_device("auto") == dv.resolve_device(None) == want
    assert dv.resolve_device("cpu") == dv.resolve_device(" CPU ") == dv.CPU
    # auto on a CPU: the mode this CPU is fast in before it has timed them (see below), float32 on request
    mode = dv.default_cpu_mode()
    assert dv.Placement.resolve("cpu") == dv.Placement(dv.CPU, dv.PACKING_DTYPES[mode], mode)
    assert dv.Placement.resolve("cpu", weights="float32") == dv.Placement(dv.CPU, torch.float32)
    assert dv.Placement.resolve("cpu", dtype="float32").mode == "float32"


def test_auto_on_a_cpu_is_packed_with_a_bfloat16_unit_and_the_integer_kernels_without(monkeypatch):
    """bfloat16 is emulated on an AVX2 mini PC or an ARM board: there the GGUF blocks' integer kernels
    (llama.cpp's arithmetic) are the default; AMX or AVX-512 BF16 keeps the packed mode."""
    import decoding.quant.native as native

    monkeypatch.setattr(native, "cpu_flags", lambda: {"avx2", "fma", "f16c", "amx_bf16"})
    assert dv.default_cpu_mode() == ("packed" if dv.mode_available("packed")[0] else "gguf")
    monkeypatch.setattr(native, "cpu_flags", lambda: {"avx2", "fma", "f16c"})
    if dv.mode_available("gguf")[0]:
        assert dv.default_cpu_mode() == "gguf"
        assert dv.Placement.resolve("cpu", weights="gguf") == dv.Placement(dv.CPU, torch.float32, "gguf")
    monkeypatch.setattr(dv, "mode_available", lambda mode: (mode == "float32", "not here"))
    assert dv.default_cpu_mode() == "float32"
    with pytest.raises(DeviceError, match="--weights gguf: not here"):
        dv.resolve_weights("gguf", dv.CPU)


def test_cuda_without_cuda_is_one_clear_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert dv.resolve_device("auto") == dv.CPU
    for spec in ("cuda", "cuda:0", "cuda:1"):
        with pytest.raises(DeviceError, match=f"--device {spec}: no CUDA device available") as exc:
            dv.resolve_device(spec)
        assert "\n" not in str(exc.value)


def test_a_cuda_index_the_machine_lacks_is_refused(monkeypatch):
    _fake_cuda(monkeypatch, count=2)
    assert dv.resolve_device("cuda") == dv.resolve_device("cuda:0") == torch.device("cuda", 0)  # always indexed
    assert dv.resolve_device("auto") == torch.device("cuda", 0)
    assert dv.resolve_device("CUDA:1") == torch.device("cuda", 1)
    with pytest.raises(DeviceError, match=r"--device cuda:2: this machine has 2 CUDA device\(s\) \(cuda:0..cuda:1\)"):
        dv.resolve_device("cuda:2")


@pytest.mark.parametrize("spec", ["gpu", "cuda:", "cuda:x", "cuda:-1", "cpu:0", "mps", "", "cuda,cpu"])
def test_garbage_devices_are_refused_before_cuda_is_asked(monkeypatch, spec):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("CUDA asked about a malformed --device"))
    with pytest.raises(DeviceError, match=r"--device must be auto, cpu, cuda or cuda:N, got"):
        dv.resolve_device(spec)


def test_per_stage_devices_give_one_per_stage_or_one_for_all():
    assert dv.resolve_devices("cpu", 3) == [dv.CPU] * 3
    assert dv.resolve_devices("cpu,cpu", 2) == [dv.CPU, dv.CPU]
    with pytest.raises(DeviceError, match="lists 2 devices for 3 stage"):
        dv.resolve_devices("cpu,cpu", 3)


def test_default_dtypes_follow_the_device(monkeypatch):
    assert dv.default_dtype(dv.CPU) == torch.float32
    _fake_cuda(monkeypatch, capability=(8, 0))
    assert dv.default_dtype(torch.device("cuda", 0)) == torch.bfloat16  # Ampere and later, Jetson Orin
    _fake_cuda(monkeypatch, capability=(7, 2))
    assert dv.default_dtype(torch.device("cuda", 0)) == torch.float16  # Jetson Xavier: no native bfloat16
    assert dv.Placement.resolve("cuda", None).dtype == torch.float16
    assert dv.Placement.resolve("cuda", "float32").dtype == torch.float32  # --dtype wins


def test_dtypes_by_name_and_garbage_refused():
    assert dv.resolve_dtype("auto", dv.CPU) == dv.resolve_dtype(None, dv.CPU) == torch.float32
    assert dv.resolve_dtype("bfloat16", dv.CPU) == torch.bfloat16
    assert dv.resolve_dtype(torch.float16, dv.CPU) == torch.float16
    for bad in ("half", "fp8", "float64"):
        with pytest.raises(DeviceError, match=r"--dtype must be auto, float32, bfloat16, float16, got"):
            dv.resolve_dtype(bad, dv.CPU)


def test_the_daemon_config_checks_device_and_dtype_spelling():
    from meshd.config import ConfigError, load_config

    cfg = load_config(None, {"MESHD_CONFIG": ""}, {"device": "cuda:1", "dtype": "bfloat16"})
    assert (cfg.device, cfg.dtype) == ("cuda:1", "bfloat16")  # spelling only: CUDA is asked at start
    assert load_config(None, {}, {}).device == "auto"
    with pytest.raises(ConfigError, match="device must be auto, cpu, cuda or cuda:N, got 'gpu'"):
        load_config(None, {"MESHD_DEVICE": "gpu"}, {})
    with pytest.raises(ConfigError, match="dtype must be"):
        load_config(None, {}, {"dtype": "half"})


def test_commands_refuse_a_device_this_machine_lacks_in_one_line(monkeypatch, capsys, tmp_path):
    from meshd.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["generate", "--prompt", "hi", "--device", "cuda", "--model", str(tmp_path / "none")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshd: error: --device cuda: no CUDA device available") and "\n" not in err
    assert main(["generate", "--prompt", "hi", "--device", "cpu,cpu", "--stages", "3"]) == 1
    assert "lists 2 devices for 3 stage" in capsys.readouterr().err


def test_profiling_a_gpu_is_refused_with_the_reason(monkeypatch, capsys, tmp_path):
    from meshd.cli import main

    _fake_cuda(monkeypatch)
    assert main(["profile", "--device", "cuda", "-o", str(tmp_path / "p.json"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "measuring a GPU (cuda:0) is not built yet" in err and "--device cpu" in err
    assert not (tmp_path / "p.json").exists()
