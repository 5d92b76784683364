"""Transport benchmark: zero-copy frames vs CURVE vs pickle vs a raw socket.

On loopback, for each tensor size, measures

  one-way throughput  the sender pushes COUNT messages of SIZE payload bytes
                      without waiting, then one request whose reply proves the
                      receiver has taken (and decoded) all of them; MB/s =
                      SIZE*COUNT / elapsed, payload bytes only, MB = 1e6 bytes.
  round-trip latency  one SIZE-byte message out, a small reply back (the
                      pipeline pattern: activations forward, an ack/token back);
                      median over the repetitions, in ms.

for four methods:

  zerocopy        transport.peer Peer -> StageServer, CURVE off, one-way sends
  zerocopy_curve  the same with CurveZMQ encryption + ZAP allow-list
  pickle          DEALER/ROUTER with pyzmq send_pyobj of {"hidden": tensor}:
                  the naive baseline (torch pickles a tensor via torch.save)
  raw             a plain TCP socket, blocking sendall / recv_into in threads,
                  each message read into one reused SIZE-byte buffer: the
                  physical ceiling of the loopback link on this machine

The receiver of every method runs in a separate process (as a real next stage
would); the client runs on uvloop when available. Ratios are to ``raw``
measured in the same run. Throughput is the median of ``--reps`` repetitions.

    .venv/bin/python bench/transport.py [--json] [--reps 3] [--sizes 4096,65536]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import pickle
import platform
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import zmq  # noqa: E402
import zmq.asyncio  # noqa: E402

from transport import loop as tloop  # noqa: E402
from transport.keys import Keypair  # noqa: E402
from transport.peer import Peer  # noqa: E402
from transport.messages import Ack  # noqa: E402
from transport.node import TransportNode  # noqa: E402
from transport.stage_messages import FreeSequence, StageForward  # noqa: E402
from transport.tuning import tune_allocator_for_large_messages  # noqa: E402

KiB, MiB = 1024, 1024 * 1024
DEFAULT_SIZES = [4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB]
METHODS = ["zerocopy", "zerocopy_curve", "pickle", "raw"]
ACTIVATION_SHAPE = (64, 576)  # 64 tokens x hidden 576 (SmolLM2-135M), float32
HWM = 64


def tput_count(size: int) -> int:
    return max(8, min(2000, (512 * MiB) // size))


def rtt_count(size: int) -> int:
    return max(5, min(300, (32 * MiB) // size))


# ============================================================ receiver process


def _raw_server(sock: socket.socket) -> None:
    """Blocking TCP receiver. Each message is read whole into one SIZE-byte
    buffer (allocated and touched once per connection, then reused, so no
    allocation or page fault is paid): the cheapest way to land a tensor's
    bytes in memory. TPUT = ack the first (warm-up) message, then read the
    rest and ack once; RTT_ = ack each message."""
    while True:
        conn, _ = sock.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            hdr = _recv_exact(conn, 20)
            if not hdr:
                continue
            op, count, size = struct.unpack("!4sQQ", hdr)
            view = memoryview(bytearray(b"\x01") * size)  # touched: no page faults later
            conn.sendall(b"r")
            for i in range(count):
                got = 0
                while got < size:
                    n = conn.recv_into(view[got:])
                    if not n:
                        break
                    got += n
                if op == b"RTT_" or i == 0:  # TPUT: the first message is a warm-up
                    conn.sendall(b"k")
            if op == b"TPUT":
                conn.sendall(b"k")


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = conn.recv(n - len(out))
        if not chunk:
            return b""
        out += chunk
    return bytes(out)


async def _serve_all(server_kp: Keypair, client_pub: bytes, ports: "mp.Queue", stop: "mp.Event") -> None:
    async def handler(msg, req):
        return None  # Ack for requests; one-way messages are just decoded

    plain = TransportNode("bench-rx", curve=False)
    await plain.start()
    srv_plain = await plain.serve(handler, "tcp://127.0.0.1:0", ordered=True, hwm=HWM)

    state = tempfile.mkdtemp(prefix="meshd-bench-")
    curve = TransportNode("bench-rx-curve", keypair=server_kp,
                          allowlist=None, state_dir=state)
    curve.admit(client_pub, "bench-client")
    await curve.start()
    srv_curve = await curve.serve(handler, "tcp://127.0.0.1:0", ordered=True, hwm=HWM)

    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.SNDHWM, HWM)
    router.setsockopt(zmq.RCVHWM, HWM)
    pport = router.bind_to_random_port("tcp://127.0.0.1")

    async def pickle_loop():
        while True:
            ident, payload = await router.recv_multipart()
            obj = pickle.loads(payload)
            if obj.get("reply"):
                await router.send_multipart([ident, pickle.dumps({"ok": True})])

    ptask = asyncio.create_task(pickle_loop())

    raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    raw.bind(("127.0.0.1", 0))
    raw.listen(4)
    threading.Thread(target=_raw_server, args=(raw,), daemon=True).start()

    ports.put({
        "zerocopy": srv_plain.address,
        "zerocopy_curve": srv_curve.address,
        "pickle": f"tcp://127.0.0.1:{pport}",
        "raw": raw.getsockname()[1],
    })
    while not stop.is_set():
        await asyncio.sleep(0.1)
    ptask.cancel()
    router.close(linger=0)
    ctx.term()
    await plain.close()
    await curve.close()


def receiver_main(server_secret: bytes, server_public: bytes, client_pub: bytes, ports, stop,
                  tune_malloc: bool = False) -> None:
    torch.set_num_threads(1)
    if tune_malloc:
        tune_allocator_for_large_messages()
    tloop.run(_serve_all(Keypair(server_public, server_secret), client_pub, ports, stop))


# ============================================================ sender side


def _payload(size: int) -> torch.Tensor:
    return torch.ones(size // 4, dtype=torch.float32)


def _fwd(t: torch.Tensor) -> StageForward:
    return StageForward("bench", 1, "bench/0/0", 0, hidden=t)


async def zc_tput(peer: Peer, size: int, count: int) -> float:
    msg = _fwd(_payload(size))
    await peer.request(msg)  # warm-up
    t0 = time.perf_counter()
    for _ in range(count):
        await peer.send(msg)
    assert isinstance(await peer.request(FreeSequence(1, "bench/0/0"), timeout=120), Ack)
    return size * count / (time.perf_counter() - t0) / 1e6


async def zc_rtt(peer: Peer, msg, count: int) -> float:
    await peer.request(msg)
    times = []
    for _ in range(count):
        t0 = time.perf_counter()
        await peer.request(msg, timeout=60)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


async def pk_tput(sock, size: int, count: int) -> float:
    t = _payload(size)
    await sock.send_pyobj({"hidden": t, "reply": True})
    await sock.recv_pyobj()
    t0 = time.perf_counter()
    for _ in range(count):
        await sock.send_pyobj({"type": "StageForward", "hidden": t})
    await sock.send_pyobj({"reply": True})
    await sock.recv_pyobj()
    return size * count / (time.perf_counter() - t0) / 1e6


async def pk_rtt(sock, t: torch.Tensor, count: int) -> float:
    obj = {"type": "StageForward", "hidden": t, "reply": True}
    await sock.send_pyobj(obj)
    await sock.recv_pyobj()
    times = []
    for _ in range(count):
        t0 = time.perf_counter()
        await sock.send_pyobj(obj)
        await sock.recv_pyobj()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _raw_conn(port: int, op: bytes, count: int, size: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.sendall(struct.pack("!4sQQ", op, count, size))
    assert s.recv(1) == b"r"  # receiver's buffer is ready
    return s


def raw_tput(port: int, size: int, count: int) -> float:
    buf = memoryview(_payload(size).numpy()).cast("B")
    with _raw_conn(port, b"TPUT", count + 1, size) as s:
        s.sendall(buf)  # warm-up: grows the TCP window like the long-lived zmq links
        assert s.recv(1) == b"k"
        t0 = time.perf_counter()
        for _ in range(count):
            s.sendall(buf)
        assert s.recv(1) == b"k"
        return size * count / (time.perf_counter() - t0) / 1e6


def raw_rtt(port: int, size: int, count: int) -> float:
    buf = memoryview(_payload(size).numpy()).cast("B")
    times = []
    with _raw_conn(port, b"RTT_", count + 1, size) as s:
        s.sendall(buf)
        s.recv(1)
        for _ in range(count):
            t0 = time.perf_counter()
            s.sendall(buf)
            assert s.recv(1) == b"k"
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


async def run_client(addrs: dict, client_kp: Keypair, server_pub: bytes, sizes, reps: int) -> dict:
    ctx = zmq.asyncio.Context()
    peers = {
        "zerocopy": Peer(node_id="bench", context=ctx, hwm=HWM, timeout=60),
        "zerocopy_curve": Peer(node_id="bench", context=ctx, hwm=HWM, timeout=60,
                               keypair=client_kp, server_key=server_pub),
    }
    for name, p in peers.items():
        await p.connect(addrs[name])
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.SNDHWM, HWM)
    dealer.setsockopt(zmq.RCVHWM, HWM)
    dealer.connect(addrs["pickle"])

    results = []
    try:
        for size in sizes:
            tc, rc = tput_count(size), rtt_count(size)
            tputs: dict[str, list[float]] = {m: [] for m in METHODS}
            # Interleave methods (rotating the order) so that background load
            # on a shared machine hits every method alike.
            for rep in range(reps):
                for method in METHODS[rep % len(METHODS):] + METHODS[: rep % len(METHODS)]:
                    if method == "raw":
                        tputs[method].append(await asyncio.to_thread(raw_tput, addrs["raw"], size, tc))
                    elif method == "pickle":
                        tputs[method].append(await pk_tput(dealer, size, tc))
                    else:
                        tputs[method].append(await zc_tput(peers[method], size, tc))
            row = {}
            for method in METHODS:
                if method == "raw":
                    rtt = await asyncio.to_thread(raw_rtt, addrs["raw"], size, rc)
                elif method == "pickle":
                    rtt = await pk_rtt(dealer, _payload(size), rc)
                else:
                    rtt = await zc_rtt(peers[method], _fwd(_payload(size)), rc)
                row[method] = (statistics.median(tputs[method]), rtt, tputs[method])
            raw_tp = row["raw"][0]
            for method in METHODS:
                tp, rtt, all_tp = row[method]
                results.append({
                    "size_bytes": size,
                    "method": method,
                    "throughput_MBps": round(tp, 1),
                    "ratio_to_raw": round(tp / raw_tp, 3),
                    "rtt_ms": round(rtt, 4),
                    "throughput_reps_MBps": [round(x, 1) for x in all_tp],
                    "count": tc,
                    "rtt_count": rc,
                })
            _print_size(size, results[-len(METHODS):])

        # The latency target: one 64-token activation message, round trip.
        act = torch.randn(*ACTIVATION_SHAPE)
        n = 500
        activation = {
            "shape": list(ACTIVATION_SHAPE),
            "bytes": act.nbytes,
            "zerocopy": round(await zc_rtt(peers["zerocopy"], _fwd(act), n), 4),
            "zerocopy_curve": round(await zc_rtt(peers["zerocopy_curve"], _fwd(act), n), 4),
            "zerocopy_fp16": round(await zc_rtt(_Fp16(peers["zerocopy"]), _fwd(act), n), 4),
            "pickle": round(await pk_rtt(dealer, act, n), 4),
            "raw": round(await asyncio.to_thread(raw_rtt, addrs["raw"], act.nbytes, n), 4),
            "count": n,
        }
    finally:
        for p in peers.values():
            await p.close()
        dealer.close(linger=0)
        ctx.term()
    return {"results": results, "activation_rtt_ms": activation}


class _Fp16:
    """A Peer view that sends activations as float16."""

    def __init__(self, peer: Peer):
        self.peer = peer

    async def request(self, msg, timeout=None):
        return await self.peer.request(msg, timeout=timeout, activation_dtype="float16")


def _fmt_size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def _print_size(size: int, rows: list[dict]) -> None:
    print(f"\n{_fmt_size(size)} ({rows[0]['count']} msgs one-way, {rows[0]['rtt_count']} round trips)")
    print(f"  {'method':<16}{'MB/s':>10}{'x raw':>8}{'rtt ms':>10}")
    for r in rows:
        print(f"  {r['method']:<16}{r['throughput_MBps']:>10.1f}{r['ratio_to_raw']:>8.2f}{r['rtt_ms']:>10.3f}")
    sys.stdout.flush()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--reps", type=int, default=5, help="throughput repetitions per point (median)")
    ap.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="payload sizes in bytes")
    ap.add_argument("--no-tune-malloc", dest="tune_malloc", action="store_false",
                    help="leave glibc's allocator as is (default: apply "
                         "transport.tuning.tune_allocator_for_large_messages(), as a daemon should)")
    args = ap.parse_args()
    from meshd import log

    log.configure()  # log lines on stderr: transport only gets loggers, the application configures them
    if args.tune_malloc:
        tune_allocator_for_large_messages()
    sizes = [int(s) for s in args.sizes.split(",")]

    import zmq.utils  # noqa: F401

    load_start = round(os.getloadavg()[0], 2)
    print("transport benchmark (loopback)")
    print(f"  cpu: {os.cpu_count()} cores ({platform.processor() or platform.machine()}), "
          f"load avg {os.getloadavg()[0]:.2f}; receiver in a separate process")
    print(f"  python {platform.python_version()}, pyzmq {zmq.pyzmq_version()}, libzmq {zmq.zmq_version()}, "
          f"torch {torch.__version__}, loop {'uvloop' if tloop.HAVE_UVLOOP else 'asyncio'}")
    print(f"  sizes: {', '.join(_fmt_size(s) for s in sizes)}; throughput = median of {args.reps}; "
          f"HWM {HWM}; MB = 1e6 bytes of payload; allocator tuning {'on' if args.tune_malloc else 'off'}")
    sys.stdout.flush()

    server_kp, client_kp = Keypair.generate(), Keypair.generate()
    mpctx = mp.get_context("spawn")
    ports, stop = mpctx.Queue(), mpctx.Event()
    proc = mpctx.Process(
        target=receiver_main,
        args=(server_kp.secret, server_kp.public, client_kp.public, ports, stop, args.tune_malloc),
        daemon=True,
    )
    proc.start()
    t0 = time.perf_counter()
    try:
        addrs = ports.get(timeout=120)
        out = tloop.run(run_client(addrs, client_kp, server_kp.public, sizes, args.reps))
    finally:
        stop.set()
        proc.join(10)
        if proc.is_alive():
            proc.terminate()
    act = out["activation_rtt_ms"]
    print(f"\nactivation message {act['shape']} float32 ({act['bytes']} B), median round trip of {act['count']}:")
    for k in ("zerocopy", "zerocopy_curve", "zerocopy_fp16", "pickle", "raw"):
        print(f"  {k:<16}{act[k]:>8.3f} ms")
    big = [r for r in out["results"] if r["method"] == "zerocopy" and r["size_bytes"] >= MiB]
    if big:
        print(f"\nzerocopy (CURVE off) >= 1 MiB: min ratio to raw {min(r['ratio_to_raw'] for r in big):.2f} "
              f"(target >= 0.70); activation rtt {act['zerocopy']:.3f} ms (target < 1 ms)")
    out["setup"] = {
        "cores": os.cpu_count(), "loop": "uvloop" if tloop.HAVE_UVLOOP else "asyncio",
        "pyzmq": zmq.pyzmq_version(), "libzmq": zmq.zmq_version(), "reps": args.reps,
        "tune_malloc": args.tune_malloc, "load_avg_start": load_start,
        "elapsed_s": round(time.perf_counter() - t0, 1),
    }
    print(f"elapsed {out['setup']['elapsed_s']} s")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
