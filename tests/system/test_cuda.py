"""On a CUDA GPU the runtime gives the CPU's answers (issue #14). Skipped where there is none (CI).

Parity is checked in float32 on both devices, where the two differ only by
summation order: the issue measured greedy output equal on 12/12 prompts and
logits within 3e-5 on an H100. The tolerance below, 1e-3 on logits of magnitude
~10-30, leaves room for other GPUs and kernels while staying far under the
margins greedy decoding depends on. Reduced precision (the GPU default) is only
checked to run end to end; its closeness is ``test_runtime_dtypes``' business.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from decoding.device import Placement
from decoding.generate import generate
from decoding.pipeline_local import LocalPipeline
from decoding.sampling import SamplingParams
from tests.support.repo import ROOT

pytestmark = [pytest.mark.cuda, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)")]

GPU = torch.device("cuda", 0)
LOGIT_ATOL = 1e-3
PROMPTS = [json.loads(line) for line in
           (ROOT / "bench" / "prompts" / "home.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(autouse=True)
def exact_float32_matmuls():
    """TF32 would round float32 products to 10 mantissa bits: not the float32 the parity is about.
    (Set by hand: these flags are module properties that monkeypatch cannot restore.)"""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.fixture(scope="module")
def cpu_pipe(real_stage):
    return LocalPipeline([real_stage])


@pytest.fixture(scope="module")
def gpu_pipe(real_source):
    pipe = LocalPipeline.from_source(real_source, 1, torch.float32, GPU)
    assert pipe.devices == [GPU] and pipe.stages[0].layers[0].qkv.device == GPU and pipe.caches[0].device == GPU
    return pipe


def chat(source, text):
    return source.tokenizer.apply_chat([{"role": "user", "content": text}])


def test_auto_picks_the_gpu_with_a_reduced_precision_default():
    p = Placement.resolve("auto")
    assert p.device == torch.device("cuda", torch.cuda.current_device())
    major, _ = torch.cuda.get_device_capability(p.device)
    assert p.dtype == (torch.bfloat16 if major >= 8 else torch.float16)
    assert p.describe()["kind"] == "cuda" and p.describe()["name"]


def test_greedy_on_the_gpu_equals_the_cpu_on_the_prompt_set(real_source, cpu_pipe, gpu_pipe):
    eos = real_source.tokenizer.eos_ids
    differ = []
    for p in PROMPTS:
        ids = chat(real_source, p["prompt"])
        want = generate(cpu_pipe, ids, p["max_new_tokens"], eos_ids=eos).token_ids
        got = generate(gpu_pipe, ids, p["max_new_tokens"], eos_ids=eos).token_ids
        if got != want:
            differ.append(p["id"])
    assert differ == [], f"GPU greedy differs from the CPU on {differ}"


def test_gpu_logits_are_within_tolerance_of_the_cpu(real_source, cpu_pipe, gpu_pipe):
    for i, p in enumerate(PROMPTS[:4]):
        ids = chat(real_source, p["prompt"])
        for pipe in (cpu_pipe, gpu_pipe):
            pipe.create(f"l{i}", len(ids) + 1)
        try:
            want = cpu_pipe.prefill(f"l{i}", ids, chunks=2, all_logits=True)
            got = gpu_pipe.prefill(f"l{i}", ids, chunks=2, all_logits=True)
        finally:
            cpu_pipe.free(f"l{i}")
            gpu_pipe.free(f"l{i}")
        assert got.device.type == "cpu" and got.dtype == torch.float32  # handed out on the host
        assert (got - want).abs().max().item() < LOGIT_ATOL


def test_seeded_sampling_on_the_gpu_draws_the_cpu_tokens(real_source, cpu_pipe, gpu_pipe):
    """The draw happens on the host from float32 probabilities: same seed, same tokens (logits that
    differ by ~1e-5 could only disagree on a draw within that distance of a CDF boundary)."""
    sampling = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=1234)
    for p in PROMPTS[:3]:
        ids = chat(real_source, p["prompt"])
        want = generate(cpu_pipe, ids, 32, sampling).token_ids
        assert generate(gpu_pipe, ids, 32, sampling).token_ids == want


def test_a_gpu_stage_and_a_cpu_stage_in_one_pipeline_equal_the_single_device_reference(real_source, cpu_pipe):
    n = real_source.config.num_layers
    mixed = LocalPipeline([real_source.load_stage(0, n // 2, torch.float32, GPU),
                           real_source.load_stage(n // 2, n, torch.float32, "cpu")])
    flipped = LocalPipeline([real_source.load_stage(0, n // 3, torch.float32, "cpu"),
                             real_source.load_stage(n // 3, n, torch.float32, GPU)])
    eos = real_source.tokenizer.eos_ids
    for p in PROMPTS[:4]:
        ids = chat(real_source, p["prompt"])
        want = generate(cpu_pipe, ids, 40, eos_ids=eos).token_ids
        assert generate(mixed, ids, 40, eos_ids=eos, chunks=2).token_ids == want
        assert generate(flipped, ids, 40, eos_ids=eos, chunks=3).token_ids == want


def test_the_gpu_default_dtype_runs_beside_a_float32_cpu_stage(real_source):
    """bfloat16/float16 activations from the GPU stage are cast by the CPU stage, as between mesh devices."""
    n = real_source.config.num_layers
    gpu = Placement.resolve("cuda")
    pipe = LocalPipeline([real_source.load_stage(0, n // 2, gpu.dtype, gpu.device),
                          real_source.load_stage(n // 2, n, torch.float32, "cpu")])
    res = generate(pipe, chat(real_source, "What is the capital of France?"), 24,
                   eos_ids=real_source.tokenizer.eos_ids, tokenizer=real_source.tokenizer)
    assert res.token_ids and "Paris" in res.text


def test_speculative_rounds_on_the_gpu_give_the_plain_greedy_tokens(real_source, cpu_pipe, gpu_pipe):
    """Tree verification and Medusa heads (copied next to the GPU's LM head) change nothing."""
    from decoding.speculative.generate import MedusaSource, speculative_generate
    from meshd.engine.drafting import medusa_heads_for

    heads = medusa_heads_for(real_source)
    medusa = MedusaSource(heads, gpu_pipe.stages[-1].lm_head)
    assert next(medusa.heads.parameters()).device == GPU and next(heads.parameters()).device.type == "cpu"
    for p in PROMPTS[:3]:
        ids = chat(real_source, p["prompt"])
        want = generate(cpu_pipe, ids, 40).token_ids
        got = speculative_generate(gpu_pipe, ids, 40, drafter="auto", medusa=medusa).token_ids
        assert got == want


async def test_a_mesh_with_a_gpu_stage_and_a_cpu_stage_equals_the_reference(real_source, cpu_pipe):
    """Stage services: host tensors on the wire, the GPU stage moving them in and its results out."""
    from meshd.pipeline.route import Route
    from tests.support.inprocess import Mesh

    async with Mesh(real_source, 2) as mesh:
        gpu_svc = mesh.services[0]
        worker = gpu_svc.worker
        worker.device, worker.dtype, worker.stage = GPU, torch.float32, None  # reload there on the next plan
        new = Route(2, mesh.route.stages)
        for svc in mesh.services:
            await svc.deploy(new)
        mesh.coord.set_route(new)
        assert gpu_svc.stage.device == GPU and gpu_svc.status()["device"] == "cuda:0"
        assert mesh.services[1].stage.device.type == "cpu"
        prompts = [chat(real_source, p["prompt"]) for p in PROMPTS[:3]]
        refs = [generate(cpu_pipe, ids, 24).token_ids for ids in prompts]
        got = await asyncio.gather(*(mesh.run(ids, 24, rid=f"g{i}", chunks=2) for i, ids in enumerate(prompts)))
        assert got == refs
        sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
        assert await mesh.run(prompts[0], 24, sampled, rid="s") == generate(cpu_pipe, prompts[0], 24, sampled).token_ids


def test_meshd_generate_across_a_gpu_and_the_cpu_prints_the_cpu_tokens(real_source, capsys):
    from meshd.cli import main

    def run(*extra):
        assert main(["generate", "--prompt", "Name two common kitchen appliances.", "--max-tokens", "24",
                     "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    ref = run("--device", "cpu")
    got = run("--device", "cuda,cpu", "--stages", "2", "--dtype", "float32")
    assert got["devices"] == ["cuda:0", "cpu"] and got["dtypes"] == ["float32", "float32"]
    assert got["token_ids"] == ref["token_ids"]


def test_early_exits_on_a_gpu_stage_leave_the_full_models_kv_and_exit_where_the_cpu_does(real_source):
    """The shipped exit heads bound to a GPU stage: tokens that leave early leave complete KV behind
    (bit for bit the full model's on the same device), and the tokens and exits match the CPU's."""
    from decoding.batch import BatchItem
    from decoding.exits.bound import BoundExits, ExitCheck
    from meshd.model.heads import embedded_exits

    cfg = real_source.config
    heads = embedded_exits(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size)
    ids = real_source.tokenizer.apply_chat([{"role": "user", "content": PROMPTS[1]["prompt"]}])

    def run(device, threshold, forced=None):
        stage = real_source.load_stage(0, cfg.num_layers, torch.float32, device)
        stage.exits = BoundExits(heads, stage) if threshold else None
        kv = stage.new_cache()
        kv.create("s", len(ids) + 40)
        with torch.inference_mode():
            out = stage.forward(kv, "s", torch.tensor(ids), all_logits=False)
            toks, layers = [], []
            for i in range(32):
                exited = isinstance(out, ExitCheck)
                toks.append(forced[i] if forced else int((out.logits if exited else out[-1]).argmax()))
                layers.append(out.layer if exited else 0)
                out = stage.forward_batch(kv, [BatchItem("s", torch.tensor([toks[-1]]), all_logits=False,
                                                         exit_threshold=threshold)])[0]
            stage.fill_pending(kv)
        return toks, layers, kv

    toks, layers, kv = run(GPU, 0.7)
    _, cpu_layers, _ = run("cpu", 0.7, forced=toks)  # the CPU's exit decisions on the GPU's tokens
    # float32 on both: the margins differ by summation order only, so a decision flips at most near 0.7
    assert any(layers) and sum(a == b for a, b in zip(layers, cpu_layers)) >= 0.9 * len(layers), (layers, cpu_layers)
    _, _, ref = run(GPU, 0.0, forced=toks)
    n = len(ids) + len(toks)
    for layer in range(cfg.num_layers):
        (k, v), = kv.segments("s", layer, n)
        (rk, rv), = ref.segments("s", layer, n)
        assert torch.equal(k, rk) and torch.equal(v, rv), f"layer {layer}"
