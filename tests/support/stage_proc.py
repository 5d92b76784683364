"""A bare stage process: serve one layer range of a fixed route, no discovery.

Used by benchmarks and multi-process tests (:class:`tests.support.proc_mesh.ProcessMesh`)
to emulate devices (each process pinned to its own core), and handy for debugging a
pipeline by hand, from the repository root (the daemon never runs it):

    python -m tests.support.stage_proc --node-id dev0 --state-dir /tmp/dev0 \\
        --bind tcp://127.0.0.1:7501 --route route.json [--threads 1] [--model PATH] [--device cuda]

``route.json``: {"plan_version": 1, "stages": [{"node_id", "address", "public_key", "first", "end"[, "group",
"group_speeds", "group_attention"]}],
"directory": {"node_id": ["address", "public_key"], ...}} — the directory also names coordinators.
Prints ``READY <address>`` on stdout once its layers are loaded; stops on SIGTERM/SIGINT. On SIGUSR1
it writes its status (the stage service's, prefix-cache counters included) to ``STATUS_FILE`` in its
state dir, so a benchmark can check between timed sections what the stages reused.

``--device`` defaults to cpu, not auto: these processes emulate CPU devices pinned
to their own cores, and on a GPU machine auto would quietly put every emulated
device on the one GPU. Name ``--device cuda`` for a stage that is the GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys

import torch


STATUS_FILE = "stage-status.json"  # written into --state-dir on SIGUSR1: {"serial": n, "status": {...}}


def load_route(path: str):
    from meshd.pipeline.route import GroupSeat, Route, StageEndpoint

    def stage(s: dict) -> StageEndpoint:
        return StageEndpoint(**{**s, "group": tuple(GroupSeat(**g) for g in s.get("group", ())),
                                "group_speeds": tuple(s.get("group_speeds", ()))})

    raw = json.loads(open(path).read())
    route = Route(int(raw["plan_version"]), tuple(stage(s) for s in raw["stages"]), index=int(raw.get("index", 0)))
    directory = {k: tuple(v) for k, v in raw.get("directory", {}).items()}
    for s in route.stages:
        directory.setdefault(s.node_id, (s.address, s.public_key))
    return route, directory


async def serve(args) -> int:
    from meshd.engine.drafting import exits_factory, medusa_factory
    from meshd.model.store import open_model
    from meshd.pipeline.stage import StageService
    from transport.node import TransportNode

    placement = args.placement
    route, directory = load_route(args.route)
    node = TransportNode(args.node_id, state_dir=args.state_dir, curve=not args.no_curve)
    await node.start()
    source = open_model(args.model)
    svc = StageService(node, args.node_id, source, lambda n: directory[n], dtype=placement.dtype, packed=placement.packed,
                       device=placement.device, activation_dtype=args.activation_dtype, medusa=medusa_factory(source, args.heads),
                       exits=exits_factory(source, args.exit_heads),
                       **({} if args.progress_every is None else {"progress_every_s": args.progress_every}),
                       **({} if args.max_batch_tokens is None else {"max_batch_tokens": args.max_batch_tokens}))
    address = await svc.start(args.bind)
    if args.group_bind:
        svc.take_groups_at(args.group_bind)
    await svc.deploy(route)
    if args.slow_layers > 1:
        slow_layers(svc.stage, args.slow_layers)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    served = 0

    def write_status() -> None:  # SIGUSR1: the harness reads counters (prefix reuse) between timed sections
        nonlocal served
        served += 1
        target = os.path.join(args.state_dir, STATUS_FILE)
        with open(target + ".tmp", "w") as f:
            json.dump({"serial": served, "status": svc.status()}, f, default=str)
        os.replace(target + ".tmp", target)

    loop.add_signal_handler(signal.SIGUSR1, write_status)
    print(f"READY {address}", flush=True)  # after the handlers: a SIGUSR1 from then on never kills us
    await stop.wait()
    print(json.dumps({"stats": svc.stats.to_dict()}), flush=True)
    await svc.close()
    await node.close()
    return 0


def slow_layers(stage, factor: float) -> None:
    """Every layer of ``stage`` takes ``factor`` times the CPU time it computes for: a device that
    many times slower, layer by layer (the compute thread sleeps; the event loop stays as fast as
    here). CPU time, not wall time: a layer preempted on a busy machine is not slowed further."""
    import time

    real = stage._layer
    stage._decode_steps = False  # every layer through _layer: the decode step kernel runs them all in one call

    def slowed(*args, **kw):
        t = time.thread_time()
        out = real(*args, **kw)
        time.sleep((factor - 1) * (time.thread_time() - t))  # sleep-ok: the emulated slow device
        return out

    stage._layer = slowed


def _die_with_parent() -> None:
    """A stage emulating a device must not outlive the harness that started it (Linux only)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--node-id", required=True)
    ap.add_argument("--state-dir", required=True)
    ap.add_argument("--bind", required=True)
    ap.add_argument("--route", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--group-bind", default="", help="where this device's tensor-group links bind (tcp://host:port), "
                    "when the route seats it in a group")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cores", default=None, help="comma-separated CPU cores to pin to")
    ap.add_argument("--activation-dtype", default=None, choices=[None, "float16", "bfloat16"])
    ap.add_argument("--no-curve", action="store_true")
    ap.add_argument("--max-batch-tokens", type=int, default=None,
                    help="tokens in one batched forward (0: one message per forward)")
    ap.add_argument("--heads", default=None, help="Medusa heads file (default: shipped heads; 'none': off)")
    ap.add_argument("--exit-heads", default=None, help="early-exit heads file (default: shipped heads; 'none': off)")
    ap.add_argument("--slow-layers", type=float, default=1.0,
                    help="every layer takes this many times as long as it computes (emulates a slower device)")
    ap.add_argument("--progress-every", type=float, default=None,
                    help="seconds between a long pass's progress reports to its coordinator (default: the stage's)")
    ap.add_argument("--device", default="cpu", help="auto, cpu (default), cuda or cuda:N")
    ap.add_argument("--dtype", default="auto", help="auto (the device's default), float32, bfloat16 or float16")
    ap.add_argument("--weights", default="float32", help="numeric mode: float32 (default), bfloat16, float16, packed, packed4, auto")
    args = ap.parse_args(argv)
    _die_with_parent()
    if args.cores:
        os.sched_setaffinity(0, {int(c) for c in args.cores.split(",")})
    torch.set_num_threads(args.threads)
    from decoding.device import Placement
    from decoding.errors import DeviceError
    from meshd import log

    try:  # before anything starts: a device this machine lacks is one line, not a traceback
        args.placement = Placement.resolve(args.device, args.dtype, args.weights if args.dtype == "auto" else None)
    except DeviceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    log.configure("json", os.environ.get("MESHD_LOG_LEVEL", "warning"))
    return asyncio.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
