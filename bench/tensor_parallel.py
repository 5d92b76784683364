"""Decode on one device vs a 2-device tensor-parallel group (and llama.cpp on one device), side by side.

Every member is its own process pinned to its own core with one torch thread (a device each); the group's
partial sums travel over its CurveZMQ links (``transport.group_link``) on loopback. Each configuration
prefills the same prompt and decodes the same greedy tokens; the figure is decode tokens/s after two
warm-up tokens. ``agreement`` is the share of the group's greedy tokens equal to one device's (the group
adds its partial sums in another order, so last bits may differ); ``deterministic``: the group gives the
same tokens twice. ``models[].fidelity``: perplexity on ``tests/data/fidelity.txt`` (teacher forced) of float32,
one gguf device and the group holding the attention each way, with each one's greedy agreement with float32
and the group's with one gguf device.

    python bench/tensor_parallel.py [--quick] [--json] [--models embedded,qwen2.5-coder-0.5b-instruct,...]
        [--tokens 48] [--llama-bin DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import emit_json, machine_banner, pinned_child  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROMPT = ("You are a voice assistant in a smart home. The user asked to turn on the kitchen ceiling light "
          "and set the living room lamp to forty percent, then asked what the weather will be like tomorrow. ")


def child(args) -> None:
    """One member (or the one device): load, link, and on rank 0 measure; prints JSON lines."""
    import torch

    torch.set_num_threads(1)
    from decoding.loader import open_model
    from meshd.pipeline.tensor.grouped import GroupedStage
    from meshd.pipeline.tensor.member import follow, load_member
    from transport.group_link import GroupLink, GroupPeer
    from transport.keys import Keypair

    src = open_model(args.model_file)
    prompt = src.tokenizer.encode(PROMPT * (args.prompt_len // 20 + 1))[: args.prompt_len]
    if args.size == 1:
        stage = src.load_stage(0, src.config.num_layers, torch.float32, packed="gguf")
        run = _Plain(stage)
    else:
        keys = Keypair.generate()
        link = GroupLink(args.rank, args.size, keys, bind=args.bind)
        stage, split = load_member(src, 0, src.config.num_layers, args.size, args.rank, link, attention=args.attention)
        print(json.dumps({"endpoint": link.endpoint, "public": keys.public.decode(), "data_port": link.data_port}),
              flush=True)
        peers = [GroupPeer(p["rank"], p["endpoint"], p["public"].encode(), p.get("data_endpoint"))
                 for p in json.loads(sys.stdin.readline())]
        others = [p for p in peers if p.rank != args.rank]
        link.admit(others)  # every member admits every key before anyone dials (as a plan tells them all)
        print(json.dumps({"admitted": True}), flush=True)
        sys.stdin.readline()
        link.connect(others)
        if args.rank:
            follow(stage, link)
            link.close()
            return
        run = _Plain(GroupedStage(stage, link, split))
    results = [_measure(run, prompt, args.tokens, f"s{i}") for i in range(args.repeats)]
    if args.batch > 1:  # several requests decoding together: one pass, one exchange per layer for all rows
        batched = [_measure_batch(run, prompt, args.tokens, args.batch, f"b{i}") for i in range(args.repeats)]
        results[0]["batched_tok_s"] = round(max(b["tok_s"] for b in batched), 2)
    if args.size > 1:
        run.stage.close()
    rss = _rss_mb()
    print(json.dumps({"result": results, "rss_mb": rss}), flush=True)


class _Plain:
    """A stage (one device's, or a group's first member's) and its cache, driven by the measurement."""

    def __init__(self, stage):
        self.stage, self.kv = stage, stage.new_cache(1 << 14)

    def create(self, seq, capacity):
        self.kv.create(seq, capacity)

    def forward(self, seq, ids, all_logits=False, best_only=False):
        """``best_only``: a greedy step reads only the best token (a group then gathers each member's best, as
        the daemon's stage asks for a plain greedy request)."""
        import torch

        from decoding.batch import BatchItem

        item = BatchItem(seq, torch.tensor(ids, dtype=torch.long), None, all_logits, best_only=best_only)
        return self.stage.forward_batch(self.kv, [item])[0]

    def free(self, seq):
        self.kv.free(seq)


def _measure(run, prompt: list[int], tokens: int, seq: str) -> dict:
    run.create(seq, len(prompt) + tokens + 8)
    t = time.perf_counter()
    logits = run.forward(seq, prompt)
    prefill_s = time.perf_counter() - t
    out, times = [], []
    for _ in range(tokens):
        tok = int(logits[-1].argmax())
        out.append(tok)
        t = time.perf_counter()
        logits = run.forward(seq, [tok], best_only=True)
        times.append(time.perf_counter() - t)
    run.free(seq)
    timed = times[2:]
    return {"prefill_s": prefill_s, "decode_tok_s": len(timed) / sum(timed), "tokens": out,
            "ms_per_token": 1000 * sum(timed) / len(timed)}


def _measure_batch(run, prompt: list[int], tokens: int, n: int, tag: str) -> dict:
    """``n`` sequences (the prompt with a different last token each) decoding in one pass a step."""
    import torch

    from decoding.batch import BatchItem

    seqs = [f"{tag}-{i}" for i in range(n)]
    last = []
    for i, seq in enumerate(seqs):
        run.create(seq, len(prompt) + tokens + 8)
        last.append(int(run.forward(seq, [*prompt[:-1], 1000 + i])[-1].argmax()))
    times = []
    for _ in range(tokens):
        items = [BatchItem(seq, torch.tensor([t]), all_logits=False, best_only=True) for seq, t in zip(seqs, last)]
        t = time.perf_counter()
        outs = run.stage.forward_batch(run.kv, items)
        times.append(time.perf_counter() - t)
        last = [int(o[-1].argmax()) for o in outs]
    for seq in seqs:
        run.free(seq)
    timed = times[2:]
    return {"tok_s": n * len(timed) / sum(timed)}


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


GROUP_PORT = 47310


def run_config(model_file: str, size: int, tokens: int, prompt_len: int, repeats: int, testbed=None,
               batch: int = 1, attention: str = "split") -> dict:
    """``size`` processes on cores 0..size-1; rank 0's measurement. ``testbed``: each member in its own
    network namespace, reaching the others through the testbed's shaped link and delay proxies."""
    def cmd(rank: int) -> list[str]:
        bind = f"tcp://{testbed.host(rank).ip}:{GROUP_PORT}" if testbed else "tcp://127.0.0.1:0"
        return [sys.executable, os.environ.get("TP_CHILD", __file__), "--child", "--rank", str(rank),
                "--size", str(size), "--model-file", model_file, "--tokens", str(tokens),
                "--prompt-len", str(prompt_len), "--repeats", str(repeats), "--bind", bind, "--batch", str(batch),
                "--attention", attention]

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if testbed:
        procs = [testbed.host(r).popen(cmd(r), cores=[r % (os.cpu_count() or 1)], env=env, **pipes)
                 for r in range(size)]
    else:
        procs = [subprocess.Popen(cmd(r), env=env, preexec_fn=pinned_child(r % (os.cpu_count() or 1)), **pipes)
                 for r in range(size)]
    try:
        if size > 1:
            hello = [_json_line(p) for p in procs]
            for me, p in enumerate(procs):
                peers = []
                for r, h in enumerate(hello):
                    endpoint, data = h["endpoint"], None
                    if testbed and r != me:  # through the link's delay, as a device on the LAN would be reached
                        ip, port = testbed.delayed_address(r, GROUP_PORT)
                        endpoint = f"tcp://{ip}:{port}"
                        ip, port = testbed.delayed_address(r, h["data_port"])  # the partial sums' stream too
                        data = f"{ip}:{port}"
                    peers.append({"rank": r, "endpoint": endpoint, "public": h["public"], "data_endpoint": data})
                p.stdin.write(json.dumps(peers) + "\n")
                p.stdin.flush()
            for p in procs:
                _json_line(p, "admitted")
            for p in procs:
                p.stdin.write("connect\n")
                p.stdin.flush()
        line = _json_line(procs[0], "result")
        rss = [line["rss_mb"]]
        got = line["result"]
        for p in procs[1:]:
            p.wait(timeout=60)
        return {"runs": got, "rss_mb_rank0": rss[0]}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def pipeline2(model_file: str, tokens: int, prompt_len: int, repeats: int, testbed=None) -> float:
    """Decode tokens/s of the product's 2-stage pipeline (stage processes on cores 0 and 1, gguf mode, the
    coordinator in this process): every token walks both stages in turn."""
    import asyncio
    import statistics

    from decoding.loader import open_model
    from decoding.sampling import SamplingSpec
    from tests.support.coordinator import generate_on
    from tests.support.proc_mesh import ProcessMesh

    src = open_model(model_file)
    half = src.config.num_layers // 2
    prompt = src.tokenizer.encode(PROMPT * (prompt_len // 20 + 1))[:prompt_len]
    kw = {}
    if testbed:
        # as bench/pipeline.py: the coordinator shares host 0 with stage 0; every other hop crosses the link
        kw = dict(hosts=[testbed.host(0).ip, testbed.host(1).ip], coordinator_host=testbed.host(0).ip,
                  launcher=lambda i, argv: testbed.host(i).popen(argv, cores=[i], env=dict(os.environ),
                                                                 stdout=subprocess.PIPE, text=True),
                  reach=lambda i, host, port: (host, port) if i == 0 else testbed.delayed_address(max(i, 0), port))

    async def run() -> float:
        rates = []
        async with ProcessMesh([(0, half), (half, src.config.num_layers)], model=model_file, cores=[[0], [1]],
                               threads=1, weights="gguf", **kw) as mesh:
            for r in range(repeats + 1):  # the first: warm-up
                stamps = []
                async for _ in generate_on(mesh.coord, f"p{r}", [*prompt[:-1], 1000 + r], tokens + 1, SamplingSpec()):
                    stamps.append(time.perf_counter())
                if r:
                    rates.append((len(stamps) - 3) / (stamps[-1] - stamps[2]))
        return statistics.median(rates)

    if testbed is None:
        return asyncio.run(run())
    from bench.pipeline import InNetns

    with InNetns(testbed.host(0).ns):  # the coordinator's sockets in host 0, beside stage 0
        return asyncio.run(run())


def planner_choice(model_path: str, one_ms: float, link: str, prompt_len: int, tokens: int) -> dict:
    """What the planner picks for two such devices over ``link``: the shipped profile of this model (any
    mode), scaled so its decode step is the one measured here, priced with tensor groups among the layouts.
    Loopback is priced as a 10 Gbit/s, 0.01 ms link: an exchange between two pinned processes here costs the
    planner's per-exchange overhead and next to no round trip (bench RESULTS)."""
    from bench._profiles import measured_profile, priced_link
    from partition.layout import Workload, choose_layout

    devs = measured_profile(model_path, one_ms / 1000, prompt_len + tokens // 2)
    if devs is None:
        return {"kind": None, "why": "no shipped profile of this model's layer count"}
    lay = choose_layout(devs, priced_link(link),
                        Workload(prompt_len, tokens, 0.0, 1), 4096, tensor=True)
    attention = next((g.tensor_attention for g in lay.groups if g.tensor), None)
    return {"kind": lay.kind, "attention": attention,
            "predicted_s": {k: round(v, 3) for k, v in lay.alternatives.items()}, "profile": devs[0].model.identity}


def _json_line(p, key: str | None = None) -> dict:
    """The child's next JSON line (with ``key``, when given), skipping log lines."""
    while True:
        raw = p.stdout.readline()
        if not raw:
            raise RuntimeError(f"a member process ended without a result (rc {p.wait()})")
        if raw.startswith("{"):
            d = json.loads(raw)
            if key is None or key in d:
                return d


def llama_cpp(bin_dir: Path | None, gguf: str, tokens: int) -> float | None:
    if bin_dir is None or not (bin_dir / "llama-bench").exists():
        return None
    out = subprocess.run(["taskset", "-c", "0", str(bin_dir / "llama-bench"), "-m", gguf, "-t", "1", "-p", "0",
                          "-n", str(tokens), "-r", "3", "-o", "json"], capture_output=True, text=True)
    if out.returncode:
        print(f"llama-bench failed: {out.stderr[-500:]}", file=sys.stderr)
        return None
    return float(json.loads(out.stdout)[0]["avg_ts"])


def model_file(name: str) -> str | None:
    from meshd.model import store

    try:
        return str(store.open_model(None if name == "embedded" else name).path)
    except Exception:  # noqa: BLE001 - not pulled here
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--attention", default="split", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--size", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--model-file", help=argparse.SUPPRESS)
    ap.add_argument("--bind", default="tcp://127.0.0.1:0", help=argparse.SUPPRESS)
    ap.add_argument("--link", default="", help="also measure the group over the testbed's shaped link "
                    "(e.g. 1gbit,0.3ms; root, network namespaces)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--models", default="embedded,qwen2.5-coder-0.5b-instruct,qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--llama-bin", default=str(Path.home() / ".cache" / "meshd-anchors" / "llama.cpp" / "build" / "bin"))
    ap.add_argument("--no-pipeline", action="store_true", help="skip the 2-stage pipeline figure")
    ap.add_argument("--batch", type=int, default=4, help="also decode this many requests at once in one pass "
                    "(one device batched vs the group batched; 1: skip)")
    ap.add_argument("--no-fidelity", action="store_true", help="skip the group's distance from one device and "
                    "from float32 (perplexity on tests/data/fidelity.txt; always skipped by --quick)")
    ap.add_argument("--quick", action="store_true", help="24 tokens, one repeat")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    if args.quick:
        args.tokens, args.repeats = 24, 1
    banner = machine_banner()
    print(f"setup: {json.dumps(banner)}")
    print(f"each device: one core (taskset), one torch thread; gguf mode; loopback CurveZMQ; "
          f"{args.prompt_len}-token prompt, {args.tokens} greedy tokens, {args.repeats} repeats")
    rows = []
    links = ["loopback"] + ([args.link] if args.link else [])
    for name in args.models.split(","):
        path = model_file(name)
        if path is None:
            print(f"{name}: not pulled here; skipped")
            continue
        one = run_config(path, 1, args.tokens, args.prompt_len, args.repeats, batch=args.batch)
        one_tok = max(r["decode_tok_s"] for r in one["runs"])
        ref = one["runs"][0]["tokens"]
        lc = llama_cpp(Path(args.llama_bin), path, args.tokens)
        fid = None
        if not (args.quick or args.no_fidelity):  # the group's sums in another order: how far that moves it
            from bench._fidelity import fidelity

            fid = fidelity(Path(path), ["gguf", "tensor2:split", "tensor2:whole"])
            print(f"{name} fidelity on {fid['tokens']} tokens: " + "; ".join(
                f"{m} perplexity {r['perplexity']:.4f} ({100 * r['perplexity_gap']:+.2f} % vs float32), agreement "
                f"{r['top1_agreement']:.4f}" + (f", with one gguf device {r['top1_agreement_one_device']:.4f}"
                                               if "top1_agreement_one_device" in r else "")
                for m, r in fid["modes"].items()), flush=True)
        for link in links:
            tb = None
            if link != "loopback":
                from bench.testbed import LinkSpec, Testbed

                tb = Testbed(2, LinkSpec.parse(link), mode="netns").start()
            try:
                two = run_config(path, 2, args.tokens, args.prompt_len, args.repeats, tb, batch=args.batch)
                whole = run_config(path, 2, args.tokens, args.prompt_len, args.repeats, tb, batch=1,
                                   attention="whole")
                pipe = None if args.no_pipeline else pipeline2(path, args.tokens, args.prompt_len, args.repeats, tb)
                # the path's own round trip, part of the link's RTT (the proxies add the rest)
                path_rtt = tb.describe()["path_rtt_ms"] if tb is not None else None
            finally:
                if tb is not None:
                    tb.close()
            two_tok = max(r["decode_tok_s"] for r in two["runs"])
            whole_tok = max(r["decode_tok_s"] for r in whole["runs"])
            agree = [sum(a == b for a, b in zip(r["tokens"], ref)) / len(ref) for r in two["runs"]]
            agree_whole = [sum(a == b for a, b in zip(r["tokens"], ref)) / len(ref) for r in whole["runs"]]
            first_diff = next((i for i, (a, b) in enumerate(zip(two["runs"][0]["tokens"], ref)) if a != b), None)
            choice = planner_choice(path, 1000 / one_tok, link, args.prompt_len, args.tokens)
            measured = {"replicas": one_tok, "tensor:split": two_tok, "tensor:whole": whole_tok, "pipeline": pipe or 0.0}
            best = max(measured.values())
            picked = f"tensor:{choice.get('attention')}" if choice["kind"] == "tensor" else choice["kind"]
            row = {"model": name, "link": link, "link_path_rtt_ms": path_rtt, "one_device_tok_s": round(one_tok, 2),
                   "tensor2_tok_s": round(two_tok, 2), "speedup": round(two_tok / one_tok, 3),
                   # the group holding the attention whole on both members (one exchange a layer)
                   "tensor2_whole_attention_tok_s": round(whole_tok, 2),
                   "speedup_whole_attention": round(whole_tok / one_tok, 3),
                   "agreement_whole_attention": round(min(agree_whole), 3),
                   "pipeline2_tok_s": None if pipe is None else round(pipe, 2),
                   "llamacpp_tok_s": None if lc is None else round(lc, 2), "planner_choice": picked,
                   "planner": choice,
                   # the chosen layout's measured rate within 10 % of the best measured one
                   "planner_within_10pct": (None if picked not in measured else measured[picked] >= 0.9 * best),
                   "agreement": round(min(agree), 3), "first_divergence": first_diff,
                   "deterministic": all(r["tokens"] == two["runs"][0]["tokens"] for r in two["runs"])
                   and all(r["tokens"] == whole["runs"][0]["tokens"] for r in whole["runs"]),
                   "rss_mb": {"one_device": round(one["rss_mb_rank0"]), "tensor2_member": round(two["rss_mb_rank0"])},
                   "ms_per_token": {"one": round(1000 / one_tok, 2), "tensor2": round(1000 / two_tok, 2)},
                   # the prompt's prefill in one pass (the group splits it the same way), best of the repeats
                   # ``batch`` requests decoding together: the group batched over one device batched
                   "batched_tok_s": {"one": one["runs"][0].get("batched_tok_s"),
                                     "tensor2": two["runs"][0].get("batched_tok_s")},
                   "speedup_batched": (round(two["runs"][0]["batched_tok_s"] / one["runs"][0]["batched_tok_s"], 3)
                                       if args.batch > 1 else None),
                   "fidelity": fid,
                   "prefill_s": {"one": round(min(r["prefill_s"] for r in one["runs"]), 4),
                                 "tensor2": round(min(r["prefill_s"] for r in two["runs"]), 4)}}
            rows.append(row)
            print(f"{name} [{link}]: one device {one_tok:.2f} tok/s, tensor2 {two_tok:.2f} tok/s "
                  f"({two_tok / one_tok:.2f}x), attention whole {whole_tok:.2f} tok/s ({whole_tok / one_tok:.2f}x, "
                  f"agreement {row['agreement_whole_attention']}), pipeline2 {row['pipeline2_tok_s']} tok/s, llama.cpp "
                  f"{row['llamacpp_tok_s']} tok/s; planner picks {picked} "
                  f"(within 10 %: {row['planner_within_10pct']}); agreement {row['agreement']}, deterministic "
                  f"{row['deterministic']}; rss one {row['rss_mb']['one_device']} MB, member "
                  f"{row['rss_mb']['tensor2_member']} MB; prefill of {args.prompt_len} tokens "
                  f"{row['prefill_s']['one']:.3f} s vs {row['prefill_s']['tensor2']:.3f} s; {args.batch} at once: "
                  f"{row['batched_tok_s']['one']} vs {row['batched_tok_s']['tensor2']} tok/s "
                  f"({row['speedup_batched']}x)", flush=True)
    result = {"setup": banner, "models": rows,
              "agreement": min((r["agreement"] for r in rows), default=None),
              "deterministic": all(r["deterministic"] for r in rows)}
    if args.json:
        emit_json(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
