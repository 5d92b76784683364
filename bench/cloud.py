"""The cloud peer: what a budget buys (quality), what it costs (time between tokens, bytes, LLM work).

Setup. The home drafts with the small model (SLM) in this process, pinned to core
0 with one torch thread. The verifier (``meshd.cloud.service``, the real one:
CURVE, sessions, continuous batching) runs the big model (LLM) in its own
process pinned to core 1 with one thread. The home's link to it is the real
CURVE link with a WAN emulated in user space on the home side: each request waits
half the RTT plus its bytes at the uplink rate before it is sent, each reply half
the RTT plus its bytes at the downlink rate (no netem in this kernel).

    full:   SLM Qwen2.5-Coder-0.5B-Instruct, LLM Qwen2.5-Coder-1.5B-Instruct (`meshd model pull` both)
    --quick: LLM = the embedded SmolLM2-135M, SLM = the same with 3 % weight noise (a stand-in)

Measured, greedy, on a fixed prompt set (bench/prompts/cloud.jsonl):
- quality per budget (0, 0.1, 0.2, 0.5, 1.0) as agreement with the LLM's own answer: exact
  match of greedy tokens position by position, and ROUGE-L F1 over tokens; edge-only
  (budget 0) is the floor; ``quality_recovered_at_0_2`` = (Q(0.2) − Q(0)) / (Q(LLM) − Q(0));
- time between tokens (after the first) vs edge-only and vs stop-and-wait verification
  (no drafting while a chunk is verified) at the set RTT, budget 1.0 and 0.2;
- bytes per verification round both ways (payload frames; CURVE adds ~33 B per message);
- cloud cost: LLM tokens computed per generated token;
- verifier throughput with 1, 4, 16 simulated homes (processes on loopback, each keeping a
  session and sending greedy verification rounds), batched vs one verification per forward.

On this 2-core machine the LLM is far slower than a cloud GPU, so times are reported as
ratios measured side by side; absolute times say nothing about a real deployment.

    .venv/bin/python bench/cloud.py [--quick] [--json] [--prompts N] [--max-tokens N] [--rtt-ms 50]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import emit_json, machine_banner, pin  # noqa: E402

BUDGETS = [0.0, 0.1, 0.2, 0.5, 1.0]
WAN = {"20mbit-40ms": (40.0, 20.0, 100.0), "2mbit-100ms": (100.0, 2.0, 20.0), "50ms": (50.0, 20.0, 100.0)}
SLM, LLM = "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"
CURVE_OVERHEAD_B = 33  # libzmq CURVE MESSAGE box: command name, flags, nonce, MAC


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------ models

QUICK_NOISE = 0.03  # relative weight noise of the quick mode's stand-in SLM


def _noisy(stage, rel: float, seed: int = 0):
    """The same model with Gaussian noise (``rel`` × each matrix's std) on every layer's weights: a
    stand-in small model that shares the tokenizer and agrees with the original often, not always
    (at 3 %: about a third of 32-token greedy answers identical, ROUGE-L ~0.6 on the quick prompts)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    for lw in stage.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            w = getattr(lw, name)
            w.add_(torch.randn(w.shape, generator=g) * float(w.std()) * rel)
    return stage


def load(which: str, quick: bool, packed: str = ""):
    """(source, stage) of the SLM or the LLM; ``packed``: the numeric mode ("" float32, "gguf": the file's
    own blocks, what a daemon picks on a CPU)."""
    from meshd.model import store as model_store

    if quick:
        src = model_store.open_model(None)
        stage = src.load_stage(0, src.config.num_layers, packed="" if which == "slm" else packed)
        return src, (_noisy(stage, QUICK_NOISE) if which == "slm" else stage)  # (noise needs float weights)
    name = SLM if which == "slm" else LLM
    if not model_store.is_named_pulled(name):
        raise SystemExit(f"{name} is not pulled: run `.venv/bin/meshd model pull {name}` (or use --quick)")
    src = model_store.open_model(name)
    return src, src.load_stage(0, src.config.num_layers, packed=packed)


# ------------------------------------------------------------------ the verifier process

def verifier_main(quick: bool, state_dir: str, ready: str, batched: bool, core: int | None,
                  listen: str = "127.0.0.1", packed: str = "", preview_layers: list[int] | None = None) -> None:
    pin([core] if core is not None else None, 1)
    from meshd.cloud.service import VerifierService

    src, stage = load("llm", quick, packed)

    async def main():
        svc = await VerifierService(src, state_dir, listen=listen, port=0, pairing_port=0,
                                    stage=stage, batched=batched, kv_budget_tokens=65536, max_queue=256,
                                    preview_layers=preview_layers).start()
        Path(ready).write_text(json.dumps({"address": svc.address, "key": svc.state.keypair().public.decode()}))
        while True:
            await asyncio.sleep(3600)

    asyncio.run(main())


class VerifierProc:
    def __init__(self, quick: bool, batched: bool = True, core: int | None = 1):
        self.dir = Path(tempfile.mkdtemp(prefix="meshd-cloud-bench-"))
        self.ready = self.dir / "ready.json"
        ctx = mp.get_context("spawn")
        self.proc = ctx.Process(target=verifier_main, args=(quick, str(self.dir / "state"), str(self.ready),
                                                            batched, core), daemon=True)
        self.proc.start()

    def wait(self, timeout: float = 600.0) -> dict:
        t = time.monotonic()
        while not self.ready.exists():
            if not self.proc.is_alive() or time.monotonic() - t > timeout:
                raise SystemExit("the verifier process did not start")
            time.sleep(0.2)
        return json.loads(self.ready.read_text())

    def admit(self, key: str) -> None:
        admit(self.dir / "state", key)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.join(10)


# ------------------------------------------------------------------ the home's link over a WAN

class WanLink:
    """A real CloudLink with an emulated WAN on the home side (user-space delay and rate)."""

    def __init__(self, link, rtt_s: float, up_bps: float, down_bps: float):
        self.link, self.rtt_s, self.up_bps, self.down_bps = link, rtt_s, up_bps, down_bps
        self.rounds: list[tuple[int, int]] = []  # (uplink, downlink) payload bytes per round

    @property
    def available(self) -> bool:
        return self.link.available

    def offers_previews(self) -> bool:
        return self.link.offers_previews()

    async def verify(self, req, timeout_s=None, on_preview=None):
        from meshd.cloud.link import to_message
        from transport.messages import encode

        from transport.cloud_messages import CloudVerdict

        up = sum(len(f) for f in encode(to_message(req), call_id=1000))
        await asyncio.sleep(self.rtt_s / 2 + 8 * (up + CURVE_OVERHEAD_B) / self.up_bps)
        if on_preview is not None and self.rtt_s:  # a preview crosses the emulated downlink too
            hint, loop = on_preview, asyncio.get_running_loop()
            on_preview = lambda p: loop.call_later(self.rtt_s / 2, hint, p)  # noqa: E731
        res = await self.link.verify(req, None if timeout_s is None else timeout_s,
                                     **({"on_preview": on_preview} if on_preview is not None else {}))
        down = len(encode(CloudVerdict(req.session, res.accepted, res.token, res.draws), call_id=1000)[0])
        await asyncio.sleep(self.rtt_s / 2 + 8 * (down + CURVE_OVERHEAD_B) / self.down_bps)
        if req.open is None:  # a usual round (a session's first request carries its prompt)
            self.rounds.append((up, down))
        return res

    async def close_session(self, session):
        await self.link.close_session(session)


def admit(verifier_state: Path | str, key: str) -> None:
    """What `meshd cloud pair` would do: the verifier admits the home's key (its allow-list is read live)."""
    from transport.keys import AllowList

    AllowList.for_state_dir(verifier_state).add(key, "bench home")


async def connect_home(address: str, server_key: str, verifier_state: Path | str):
    """A fresh home key, admitted at the verifier, and a real CloudLink to it (patient timeouts: a CPU verifier)."""
    from meshd.cloud.link import CloudLink
    from transport.keys import AllowList, Keypair
    from transport.node import TransportNode

    kp = Keypair.generate()
    admit(verifier_state, kp.public.decode())
    node = TransportNode("bench-home", keypair=kp, allowlist=AllowList(Path(tempfile.mkdtemp()) / "allow"))
    await node.start()
    peer = await node.connect(address, server_key=server_key, timeout=600.0)
    return node, CloudLink(peer, address, first_timeout_s=600.0, min_timeout_s=30.0)


def load_prompts(tok, n: int) -> tuple[list[dict], list[list[int]]]:
    """The first ``n`` rows of bench/prompts/cloud.jsonl and their chat-templated token ids."""
    rows = [json.loads(x) for x in (ROOT / "bench" / "prompts" / "cloud.jsonl").read_text().splitlines() if x][:n]
    return rows, [tok.apply_chat([{"role": "user", "content": r["prompt"]}]) for r in rows]


# ------------------------------------------------------------------ quality measures

def rouge_l(a: list[int], b: list[int]) -> float:
    if not a or not b:
        return 0.0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    p, r = lcs / len(a), lcs / len(b)
    return 2 * p * r / (p + r)


def exact(a: list[int], ref: list[int]) -> float:
    n = max(len(a), len(ref))
    return sum(1 for x, y in zip(a, ref) if x == y) / n if n else 1.0


# ------------------------------------------------------------------ one answer

async def answer(slm_stage, link, prompt, max_tokens, budget, eos, session, ahead=None, policy=None, seed=None,
                 previews=None):
    """One answer. ``seed`` (default: the session) draws the offload decisions: give two modes the same
    seed and the same policy state and they offload the same chunks."""
    from decoding.offload.local import LocalDrafter
    from decoding.offload.loop import AHEAD, OffloadDecoder
    from decoding.offload.policy import OffloadPolicy
    from decoding.pipeline_local import LocalPipeline

    drafter = LocalDrafter(LocalPipeline([slm_stage]), capacity=len(prompt) + max_tokens + 32)
    dec = OffloadDecoder(drafter, link, policy or OffloadPolicy(budget), session, eos_ids=frozenset(eos),
                         seed=session if seed is None else seed,
                         ahead=AHEAD if ahead is None else ahead, previews=previews)
    out, times = [], []
    t0 = time.perf_counter()
    try:
        async for t in dec.run(prompt, max_tokens):
            out.append(t)
            times.append(time.perf_counter())
    finally:
        drafter.close()
    tbt = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    return {"tokens": out, "tbt_s": tbt, "total_s": time.perf_counter() - t0, "stats": dec.stats.to_dict(),
            "first_s": times[0] - t0 if times else 0.0}


# ------------------------------------------------------------------ how well the filters pick chunks

def recording_policy(budget: float):
    """An OffloadPolicy that remembers, per chunk, what the filters saw and what the verifier said."""
    from decoding.offload.policy import OffloadPolicy

    class Recording(OffloadPolicy):
        def decide(self, confidence, importance, generated, max_tokens, rng):
            self.chunks.append({"conf": confidence, "imp": importance, "pos": generated, "max": max_tokens})
            return super().decide(confidence, importance, generated, max_tokens, rng)

        def observe(self, confidence, accepted, drafted):
            if self.chunks and "accepted" not in self.chunks[-1]:
                self.chunks[-1].update(accepted=accepted, drafted=drafted)
            super().observe(confidence, accepted, drafted)

    pol = Recording(budget)
    pol.chunks = []
    return pol


def _auc(score, positive) -> float | None:
    """P(score of a positive > score of a negative), ties half (Mann-Whitney)."""
    import numpy as np

    s, y = np.asarray(score, dtype=float), np.asarray(positive, dtype=bool)
    pos, neg = s[y], s[~y]
    if not len(pos) or not len(neg):
        return None
    gt = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(gt / (len(pos) * len(neg)))


def selection_quality(chunks: list[dict], budget: float = 0.2) -> dict:
    """Every chunk verified (budget 1.0): would the filters have sent the ones the LLM corrects?

    A chunk is *corrected* when the verifier rejected one of its drafts. Reported: how well each
    signal ranks corrected chunks above the others (AUC; 0.5 = no better than chance), and the
    share of corrected chunks among the ``budget`` share that each ranking would offload, against
    the share among all chunks (what a random choice gets) and the best possible."""
    import numpy as np

    from decoding.offload.policy import LATE_FRACTION, OffloadPolicy, _p_conf_vec, _p_imp_vec

    rows = [c for c in chunks if "accepted" in c and c["pos"] < LATE_FRACTION * c["max"]]
    if len(rows) < 8:
        return {"chunks": len(rows)}
    conf = np.array([c["conf"] for c in rows])
    imp = np.array([c["imp"] for c in rows])
    pos = np.array([c["pos"] / c["max"] for c in rows])
    corrected = np.array([c["accepted"] < c["drafted"] for c in rows])
    fit = OffloadPolicy(budget)
    fit.window.extend(zip(conf.tolist(), imp.tolist()))
    c_th, i_th = fit.thresholds()
    policy_score = _p_conf_vec(conf, c_th) * _p_imp_vec(imp, i_th)
    k = max(1, round(budget * len(rows)))

    def top_share(score) -> float:
        order = np.argsort(-np.asarray(score, dtype=float), kind="stable")[:k]
        return float(corrected[order].mean())

    return {
        "chunks": len(rows), "corrected_share": float(corrected.mean()),
        "auc": {"low_confidence": _auc(-conf, corrected), "importance": _auc(imp, corrected),
                "policy_score_at_budget": _auc(policy_score, corrected), "early_position": _auc(-pos, corrected)},
        f"corrected_among_top_{budget}": {"policy": top_share(policy_score), "low_confidence": top_share(-conf),
                                          "importance": top_share(imp), "random": float(corrected.mean()),
                                          "best": min(1.0, float(corrected.sum()) / k)},
        "thresholds_at_budget": {"c_th": c_th, "i_th": i_th},
    }


# ------------------------------------------------------------------ verifier throughput

def home_main(info: dict, key_secret: tuple[str, str], prompt: list[int], rounds: int, start_evt, out_q) -> None:
    pin(None, 1)
    from transport.cloud_messages import CloudVerify
    from transport.keys import AllowList, Keypair
    from transport.node import TransportNode

    async def main():
        kp = Keypair(key_secret[0].encode(), key_secret[1].encode())
        node = TransportNode("home", keypair=kp, allowlist=AllowList(Path(tempfile.mkdtemp()) / "a"))
        await node.start()
        peer = await node.connect(info["address"], server_key=info["key"], timeout=600.0)
        pk = lambda xs: struct.pack(f"<{len(xs)}I", *xs)  # noqa: E731
        r = await peer.request(CloudVerify(1, 0, pk(prompt + prompt[:4]), 4, open={"capacity": 4096}), timeout=600)
        n = len(prompt) + r.accepted
        tail = [r.token]
        start_evt.wait()
        t0 = time.perf_counter()
        done = 0
        for i in range(rounds):  # each round: the last verdict's token as root, 4 drafts from the prompt
            drafts = prompt[(i * 4) % (len(prompt) - 4):][:4]
            r = await peer.request(CloudVerify(1, n, pk(tail + drafts), 4), timeout=600)
            n += len(tail) + r.accepted
            tail = [r.token]
            done += 1
        out_q.put((done, time.perf_counter() - t0))
        await node.close()

    asyncio.run(main())


def throughput(quick: bool, batched: bool, homes: int, rounds: int, prompt: list[int]) -> float:
    """Verification rounds per second over ``homes`` concurrent home processes."""
    from transport.keys import Keypair

    v = VerifierProc(quick, batched=batched, core=1)
    info = v.wait()
    ctx = mp.get_context("spawn")
    start, q = ctx.Event(), ctx.Queue()
    procs = []
    for h in range(homes):
        kp = Keypair.generate()
        v.admit(kp.public.decode())
        p = ctx.Process(target=home_main, args=(info, (kp.public.decode(), kp.secret.decode()),
                                                prompt[h % 7:] + prompt[:h % 7], rounds, start, q), daemon=True)
        p.start()
        procs.append(p)
    time.sleep(2.0)  # the homes open their sessions (each waits for ``start`` before its timed rounds)
    start.set()
    results = [q.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join(10)
    v.stop()
    total = sum(d for d, _ in results)
    span = max(s for _, s in results)
    return total / span


# ------------------------------------------------------------------ main

async def run(args) -> dict:
    pin([0], 1)
    src, slm = load("slm", args.quick)
    tok = src.tokenizer
    eos = tuple(tok.eos_ids)
    rows, prompts = load_prompts(tok, args.prompts or (3 if args.quick else 8))
    max_tokens = args.max_tokens or (32 if args.quick else 48)
    setup = {**machine_banner(), "mode": "quick" if args.quick else "full",
             "slm": f"SmolLM2-135M + {QUICK_NOISE:.0%} weight noise (stand-in)" if args.quick else SLM,
             "llm": "SmolLM2-135M (30 layers)" if args.quick else LLM,
             "home": {"cores": [0], "threads": 1}, "verifier": {"cores": [1], "threads": 1},
             "wan": args.wan, "rtt_ms": args.rtt_ms, "uplink_mbit": args.up_mbit, "downlink_mbit": args.down_mbit,
             "prompts": len(prompts), "max_tokens": max_tokens, "sampling": "greedy", "gamma": 4}
    log(f"setup: {json.dumps(setup)}")

    vproc = VerifierProc(args.quick, core=1)
    info = vproc.wait()
    node, link = await connect_home(info["address"], info["key"], vproc.dir / "state")
    wan = WanLink(link, args.rtt_ms / 1000, args.up_mbit * 1e6, args.down_mbit * 1e6)

    # The LLM's own greedy answers: budget 1.0 with verification is the reference only if it
    # equals this, which is computed by the LLM alone (in the verifier process's model? no:
    # here, independently, with the same code path a single device uses).
    from decoding.generate import generate
    from decoding.pipeline_local import LocalPipeline
    _, llm_local = load("llm", args.quick)
    refs = []
    for i, p in enumerate(prompts if not args.selection_only else ()):
        # The home's answers end with the EOS they committed; the reference too, where it stops.
        g = generate(LocalPipeline([llm_local]), p, max_tokens).token_ids
        end = next((j + 1 for j, t in enumerate(g) if t in eos), len(g))
        refs.append(g[:end])
        log(f"LLM reference {i + 1}/{len(prompts)}: {len(refs[-1])} tokens")

    from decoding.offload.policy import OffloadPolicy
    runs: dict = {}
    divergences: list = []
    session = 100
    selection = None
    for b in BUDGETS if not args.selection_only else [1.0]:
        # one policy per budget, shared by the prompts (as a home shares it)
        policy = recording_policy(b) if b == 1.0 else OffloadPolicy(b)
        per = []
        wan.rounds = []
        for i, p in enumerate(prompts):
            session += 1
            r = await answer(slm, wan, p, max_tokens, b, eos, session, policy=policy)
            ref = refs[i] if refs else r["tokens"]  # --selection-only: no reference answers computed
            r["exact"], r["rouge_l"] = exact(r["tokens"], ref), rouge_l(r["tokens"], ref)
            r["identical"] = r["tokens"] == ref
            if b == 1.0 and not r["identical"]:
                k = next((j for j, (x, y) in enumerate(zip(r["tokens"], refs[i])) if x != y),
                         min(len(r["tokens"]), len(refs[i])))
                divergences.append({"prompt": rows[i]["id"], "position": k, "verified": r["tokens"][k:k + 3],
                                    "reference": refs[i][k:k + 3], "context": refs[i][:k]})
            per.append(r)
            log(f"budget {b}: prompt {i + 1}/{len(prompts)} exact {r['exact']:.2f} rouge-L {r['rouge_l']:.2f} "
                f"tbt {r['tbt_s'] * 1000:.0f} ms offloaded {r['stats']['offloaded']}/{r['stats']['chunks']}")
        gen = sum(len(r["tokens"]) for r in per)
        runs[str(b)] = {
            "exact": statistics.mean(r["exact"] for r in per), "rouge_l": statistics.mean(r["rouge_l"] for r in per),
            "identical": sum(r["identical"] for r in per), "tbt_ms": 1000 * statistics.mean(r["tbt_s"] for r in per),
            "chunks": sum(r["stats"]["chunks"] for r in per), "offloaded": sum(r["stats"]["offloaded"] for r in per),
            "accepted_per_chunk": (sum(r["stats"]["accepted"] for r in per)
                                   / max(1, sum(r["stats"]["verified"] for r in per))),
            "llm_tokens_per_generated_token": sum(r["stats"]["llm_tokens"] for r in per) / max(1, gen),
            # Cloud-only serving computes every prompt and answer token on the LLM:
            "llm_tokens_vs_cloud_only": (sum(r["stats"]["llm_tokens"] for r in per)
                                         / max(1, gen + sum(len(p) for p in prompts))),
            "generated": gen,
            "local_fallbacks": sum(r["stats"]["local_fallbacks"] for r in per),
            "stall_s": sum(r["stats"]["stall_s"] for r in per),
            "share_offloaded": policy.share, "policy": policy.to_dict(),
            "uplink_bytes_per_round": statistics.mean(u for u, _ in wan.rounds) if wan.rounds else 0.0,
            "downlink_bytes_per_round": statistics.mean(d for _, d in wan.rounds) if wan.rounds else 0.0,
        }
        if b == 1.0:
            selection = selection_quality(policy.chunks)
            log(f"selection: {json.dumps(selection)}")
    if args.selection_only:
        await node.close()
        vproc.stop()
        return {"setup": setup, "selection": selection, "runs": runs}

    # Where budget 1.0 differed from the reference: how close were the two tokens in the LLM's own logits?
    import torch
    by_id = {r["id"]: p for r, p in zip(rows, prompts)}
    for d in divergences:
        pipe = LocalPipeline([llm_local])
        pipe.create("gap", len(by_id[d["prompt"]]) + len(d["context"]) + 1)
        lg = pipe.forward("gap", torch.tensor(by_id[d["prompt"]] + d["context"]))[-1]
        both = d["reference"] and d["verified"]
        d["logit_gap"] = float(lg[d["reference"][0]] - lg[d["verified"][0]]) if both else None
        d["top_logit"] = float(lg.max())
        del d["context"]
    del llm_local

    # Stop-and-wait against stall-free, side by side, at budget 1.0 and 0.2.
    timing = {}
    for b in (() if args.skip_timing else (1.0, 0.2)):
        for mode, ahead in (("stall_free", None), ("stop_and_wait", 0)):
            tbts = []
            policy = OffloadPolicy(b)  # shared by the prompts, as a home shares it; same seeds in both modes
            for i, p in enumerate(prompts):
                session += 1
                r = await answer(slm, wan, p, max_tokens, b, eos, session, ahead=ahead, policy=policy,
                                 seed=7000 + i)
                tbts.append(r["tbt_s"])
            timing[f"{mode}@{b}"] = 1000 * statistics.mean(tbts)
            log(f"{mode} at budget {b}: {timing[f'{mode}@{b}']:.0f} ms between tokens")
    await node.close()
    vproc.stop()

    # Verifier throughput: simulated homes (processes), batched vs one verification per forward.
    through = {}
    if not args.skip_throughput:
        tp_prompt = prompts[0][:64]
        for homes in args.homes:
            for batched in (True, False):
                rounds = max(2, (6 if args.quick else 3) * (4 if homes == 1 else 1))
                rate = throughput(args.quick, batched, homes, rounds, tp_prompt)
                through[f"{homes}_{'batched' if batched else 'serial'}"] = rate
                log(f"{homes} homes, {'batched' if batched else 'one at a time'}: {rate:.2f} verifications/s")

    edge, full = runs["0.0"], runs["1.0"]
    gap = 1.0 - edge["rouge_l"]
    result = {
        "setup": setup,
        "identical_at_budget_1": full["identical"] == len(prompts),
        "quality_recovered_at_0_2": (runs["0.2"]["rouge_l"] - edge["rouge_l"]) / gap if gap > 0 else 1.0,
        "quality_recovered_at_0_2_exact": ((runs["0.2"]["exact"] - edge["exact"]) / (1 - edge["exact"])
                                           if edge["exact"] < 1 else 1.0),
        "uplink_bytes_per_round": full["uplink_bytes_per_round"],  # greedy, budget 1.0: root + 4 drafts
        "downlink_bytes_per_round": full["downlink_bytes_per_round"],
        "uplink_bytes_per_round_at_0_2": runs["0.2"]["uplink_bytes_per_round"],
        "curve_overhead_bytes_per_message": CURVE_OVERHEAD_B,
        "tbt_vs_edge_only_at_0_2": runs["0.2"]["tbt_ms"] / edge["tbt_ms"],
        "tbt_vs_edge_only_at_1": full["tbt_ms"] / edge["tbt_ms"],
        "stall_free_speedup": (timing["stop_and_wait@1.0"] / timing["stall_free@1.0"]) if timing else None,
        "stall_free_speedup_at_0_2": (timing["stop_and_wait@0.2"] / timing["stall_free@0.2"]) if timing else None,
        "divergences_at_budget_1": divergences,
        "selection_at_budget_1": selection,
        "verifier_batching_speedup": (through.get("16_batched", 0) / through["16_serial"]
                                      if through.get("16_serial") else None),
        "timing_ms": timing, "throughput_per_s": through, "runs": runs,
    }
    return result


def plot(result: dict, path: Path) -> None:
    """Quality and time between tokens per budget, and verifier throughput per home count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    budgets = [float(b) for b in runs]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    ax = axes[0]
    ax.plot(budgets, [runs[b]["rouge_l"] for b in runs], "o-", label="ROUGE-L vs LLM answer")
    ax.plot(budgets, [runs[b]["exact"] for b in runs], "s--", label="exact-match rate")
    ax.set_xlabel("cloud budget")
    ax.set_ylim(0, 1.05)
    ax.set_title("agreement with the LLM's greedy answer")
    ax.legend(fontsize=8)
    ax = axes[1]
    edge = runs[next(iter(runs))]["tbt_ms"]
    ax.plot(budgets, [runs[b]["tbt_ms"] / edge for b in runs], "o-")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("cloud budget")
    ax.set_title(f"time between tokens / edge-only ({result['setup']['rtt_ms']:.0f} ms RTT)")
    ax = axes[2]
    tp = result.get("throughput_per_s") or {}
    homes = sorted({int(k.split("_")[0]) for k in tp})
    if homes:
        x = range(len(homes))
        ax.bar([i - 0.2 for i in x], [tp.get(f"{h}_batched", 0) for h in homes], 0.4, label="batched")
        ax.bar([i + 0.2 for i in x], [tp.get(f"{h}_serial", 0) for h in homes], 0.4, label="one at a time")
        ax.set_xticks(list(x), [str(h) for h in homes])
        ax.set_xlabel("homes")
        ax.legend(fontsize=8)
    ax.set_title("verifier: verifications / s")
    s = result["setup"]
    fig.suptitle(f"cloud verification: SLM {s['slm']}, LLM {s['llm']} (2-core CPU: ratios only)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--wan", choices=sorted(WAN), default="50ms",
                    help="home uplink profile: RTT, uplink and downlink rate (default 50 ms, 20/100 Mbit/s)")
    ap.add_argument("--rtt-ms", type=float, default=None)
    ap.add_argument("--up-mbit", type=float, default=None)
    ap.add_argument("--down-mbit", type=float, default=None)
    ap.add_argument("--homes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16])
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-timing", action="store_true", help="no stall-free vs stop-and-wait runs")
    ap.add_argument("--selection-only", action="store_true",
                    help="only budget 1.0, recording per chunk whether the filters would have picked the chunks "
                         "the LLM corrected (no reference answers, timing or throughput)")
    ap.add_argument("--out", default=None, help="also write the JSON here (and a plot next to it, .png)")
    ap.add_argument("--plot-only", default=None, metavar="JSON", help="only draw the plot of a saved run")
    args = ap.parse_args()
    if args.plot_only:
        plot(json.loads(Path(args.plot_only).read_text()), Path(args.plot_only).with_suffix(".png"))
        return
    rtt, up, down = WAN[args.wan]
    args.rtt_ms = rtt if args.rtt_ms is None else args.rtt_ms
    args.up_mbit = up if args.up_mbit is None else args.up_mbit
    args.down_mbit = down if args.down_mbit is None else args.down_mbit
    t = time.perf_counter()
    result = asyncio.run(run(args))
    result["wall_s"] = round(time.perf_counter() - t, 1)
    if args.selection_only:
        print(json.dumps(result["selection"], indent=1))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
        if args.json:
            emit_json(result)
        return
    print("\nbudget  exact  rouge-L  identical  tbt(ms)  offloaded  acc/chunk  LLM tok/gen tok  up B/round")
    for b, r in result["runs"].items():
        print(f"{b:>6}  {r['exact']:.3f}  {r['rouge_l']:.3f}    {r['identical']:>2}     {r['tbt_ms']:7.0f}  "
              f"{r['offloaded']:>4}/{r['chunks']:<4}  {r['accepted_per_chunk']:.2f}       "
              f"{r['llm_tokens_per_generated_token']:.2f}            {r['uplink_bytes_per_round']:.1f}")
    for k in ("identical_at_budget_1", "quality_recovered_at_0_2", "uplink_bytes_per_round",
              "downlink_bytes_per_round", "tbt_vs_edge_only_at_0_2", "stall_free_speedup",
              "verifier_batching_speedup"):
        print(f"{k}: {result[k]}")
    print(f"throughput (verifications/s): {result['throughput_per_s']}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
        plot(result, Path(args.out).with_suffix(".png"))
    if args.json:
        emit_json(result)


if __name__ == "__main__":
    main()
