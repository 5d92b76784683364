"""N emulated home devices on one Linux machine: namespaces, a bridge, shaped links.

Topology (netns mode, needs root)::

    P-h0 [eth0 10.213.0.1] ==veth== [h0]-+
    P-h1 [eth0 10.213.0.2] ==veth== [h1]-+- br0 10.213.0.254   (namespace P-sw)
    ...                                   +- delay proxies listen here

Every host link is shaped with ``tbf`` on both ends (host egress = uplink,
switch egress = downlink), so a flow A->B crosses A's uplink and B's downlink
bucket, like two Wi-Fi clients of one access point. The subnet is private to
these namespaces: no default route, no link to the machine's interfaces, so
nothing can leave. ``224.0.0.0/4`` is routed on-link so mDNS works between hosts.

Delay: the kernel has no netem, so ``delayed_address`` starts a
:mod:`~bench.testbed.delay_proxy` *in the switch namespace*. It is the "air"
between hosts: a peer connecting to it crosses its own shaped uplink, the
proxy (rtt/2 each way), then the destination's shaped downlink, so rate and
delay combine exactly as on a direct path, and no host's CPU core is charged
for the proxy (it is not pinned: it is the network, not a device).

Without root, or when ``ip netns`` fails, hosts are plain processes on loopback
addresses 127.0.0.1, 127.0.0.2, ... (all of 127/8 is loopback on Linux, so
hosts can reuse ports), still pinned to cores; shaping is off, the delay proxy
still works (it is user space).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.testbed import netns
from bench.testbed.linkspec import LinkSpec
from bench.testbed.netns import TestbedError

SUBNET_PREFIX = "10.213.0."
SUBNET_LEN = 24
SWITCH_IP = SUBNET_PREFIX + "254"
REPO_ROOT = Path(__file__).resolve().parents[2]
FALLBACK_LINE = "testbed: no root / netns unavailable — falling back to loopback processes; link shaping disabled"


class TestbedBusy(TestbedError):
    """Another live process owns a testbed with this prefix."""


def _python_env(env: dict[str, str] | None) -> dict[str, str]:
    """Child environment in which ``python -m bench.…`` resolves to this checkout."""
    out = dict(os.environ if env is None else env)
    pp = out.get("PYTHONPATH", "")
    if str(REPO_ROOT) not in pp.split(os.pathsep):
        out["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), pp) if p)
    return out


@dataclass
class Host:
    """One emulated device. ``ns`` is None in loopback mode."""

    index: int
    ip: str
    ns: str | None
    default_cores: list[int]
    _testbed: "Testbed" = field(repr=False)

    def command(self, argv: list[str], cores: list[int] | None = None) -> list[str]:
        """The full argv that runs ``argv`` inside this host, pinned to ``cores``.

        Use it with your own launcher (e.g. ``asyncio.create_subprocess_exec``);
        prefer :meth:`popen`, which also guarantees the process is killed on teardown.
        """
        cores = self.default_cores if cores is None else cores
        prefix: list[str] = ["ip", "netns", "exec", self.ns] if self.ns else []
        if cores and shutil.which("taskset"):
            prefix += ["taskset", "-c", ",".join(map(str, cores))]
        return prefix + list(argv)

    def popen(
        self,
        argv: list[str],
        cores: list[int] | None = None,
        env: dict[str, str] | None = None,
        **kwargs,
    ) -> subprocess.Popen:
        """Start ``argv`` in this host (own process group), tracked for teardown.

        ``env`` replaces the environment (PYTHONPATH gains the repo root so
        ``python -m bench…``/``meshd`` modules resolve).
        """
        return self._testbed._spawn(self.command(argv, cores), env, **kwargs)

    def run(self, argv: list[str], timeout: float = 60.0, cores: list[int] | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run to completion in this host, capturing text output; killed after ``timeout``."""
        p = self.popen(argv, cores=cores, env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._testbed._kill(p)
            out, err = p.communicate()
            raise TestbedError(f"testbed: {argv[:4]} in host {self.index} timed out after {timeout}s")
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)


class Testbed:
    """``with Testbed(2, LinkSpec.parse("100mbit,4ms")) as tb: tb.host(1).popen([...])``.

    ``mode``: ``"auto"`` (netns when root and it works, else loopback with a
    printed notice), ``"netns"`` (fail instead of falling back) or
    ``"loopback"``. After entering, ``tb.mode`` says which one is running.
    """

    __test__ = False  # not a pytest test class despite the name

    def __init__(self, n_hosts: int, link: LinkSpec | str | None = None,
                 name_prefix: str = "meshd-tb", mode: str = "auto",
                 host_links: dict[int, LinkSpec | str] | None = None):
        if not 1 <= n_hosts <= 200:
            raise TestbedError("testbed: n_hosts must be 1..200")
        if mode not in ("auto", "netns", "loopback"):
            raise TestbedError(f"testbed: unknown mode {mode!r}")
        self.n_hosts = n_hosts
        self.link = link if isinstance(link, LinkSpec) else LinkSpec.parse(link)
        # A host whose link differs from the others': a home's WAN uplink next to an unshaped cloud host.
        self.host_links = {int(i): (v if isinstance(v, LinkSpec) else LinkSpec.parse(v))
                           for i, v in (host_links or {}).items()}
        if any(not 0 <= i < n_hosts for i in self.host_links):
            raise TestbedError("testbed: host_links names a host that does not exist")
        self.prefix = name_prefix
        self.requested_mode = mode
        self.mode: str | None = None
        self.fallback_reason: str | None = None
        self.hosts: list[Host] = []
        self._procs: list[subprocess.Popen] = []
        self._proxies: dict[tuple[int, int, float], tuple[subprocess.Popen, tuple[str, int]]] = {}
        self._path_rtt_s: float | None = None  # measured at the first delayed address
        self._lock: netns.OwnerLock | None = None
        self._namespaces: list[str] = []
        self._old_handlers: dict[int, object] = {}
        self._closing = False
        self._mutex = threading.RLock()

    # ---- lifecycle -------------------------------------------------------

    def __enter__(self) -> "Testbed":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> "Testbed":
        self._install_signal_handlers()
        atexit.register(self.close)
        try:
            if self.requested_mode != "loopback":
                reason = self._netns_unavailable_reason()
                if reason is None:
                    try:
                        self._build_netns()
                        self.mode = "netns"
                    except TestbedBusy:
                        raise  # a live testbed owns this prefix: not a reason to fall back
                    except TestbedError as e:
                        self._teardown_netns()
                        reason = str(e)
                if self.mode is None:
                    if self.requested_mode == "netns":
                        raise TestbedError(f"testbed: netns mode unavailable: {reason}")
                    self.fallback_reason = reason
                    print(FALLBACK_LINE, f"({reason})", file=sys.stderr, flush=True)
            if self.mode is None:
                self._build_loopback()
                self.mode = "loopback"
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Kill every process, delete every namespace; idempotent and safe mid-build."""
        with self._mutex:
            if self._closing:
                return
            self._closing = True
        try:
            self._kill_all(self._procs)  # proxies are in _procs too
            self._teardown_netns()
        finally:
            self._restore_signal_handlers()
            try:
                atexit.unregister(self.close)
            except Exception:
                pass

    # ---- queries ---------------------------------------------------------

    def host(self, i: int) -> Host:
        return self.hosts[i]

    @property
    def shaped(self) -> bool:
        return self.mode == "netns" and self.link.shaped

    def describe(self) -> dict:
        """Setup summary for benchmark banners/JSON."""
        return {
            "mode": self.mode,
            "hosts": [{"ip": h.ip, "ns": h.ns, "cores": h.default_cores,
                       **({"link": str(self.host_links[h.index])} if h.index in self.host_links else {})}
                      for h in self.hosts],
            "link": str(self.link),
            "link_human": self.link.describe(),
            "rate_shaped": self.shaped,
            "tbf": " ".join(self.link.tbf_args()) if self.shaped else None,
            "delay": (f"user-space proxy ({'compiled' if compiled_delay_proxy() else 'Python'}) "
                      + ("in switch ns" if self.mode == "netns" else "on loopback")),
            "fallback_reason": self.fallback_reason,
            # what a delayed address adds is the link's RTT less this (None: no delay asked for yet)
            "path_rtt_ms": None if self._path_rtt_s is None else round(self._path_rtt_s * 1e3, 3),
        }

    def link_of(self, host_index: int) -> LinkSpec:
        return self.host_links.get(host_index, self.link)

    def delayed_address(self, host_index: int, port: int, rtt_s: float | None = None,
                        proxy: bool | None = None) -> tuple[str, int]:
        """An address that reaches ``host(host_index):port`` with the link's RTT added.

        Starts (once per host/port/rtt) a delay proxy that forwards to the real
        service, which must listen on the host's ip (or 0.0.0.0). ``rtt_s``
        overrides the link's RTT. With no RTT to add, the direct address is
        returned unless ``proxy=True`` (used to measure the proxy's own cost).
        """
        rtt = self.link.rtt_s if rtt_s is None else rtt_s
        target = (self.hosts[host_index].ip, port)
        if rtt <= 0 and not proxy:
            return target
        key = (host_index, port, rtt)
        with self._mutex:
            if key in self._proxies:
                return self._proxies[key][1]
            one_way_ms = self.added_one_way_s(rtt) * 1000
            listen = f"{SWITCH_IP}:0" if self.mode == "netns" else "127.0.0.1:0"
            compiled = compiled_delay_proxy()
            program = [str(compiled)] if compiled else [sys.executable, "-m", "bench.testbed.delay_proxy"]
            argv = [*program, "--listen", listen, "--target", f"{target[0]}:{target[1]}",
                    "--one-way-ms", repr(one_way_ms)]
            if self.mode == "netns":
                argv = ["ip", "netns", "exec", self._switch_ns()] + argv
            p = self._spawn(argv, None, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            addr = _read_ready(p, timeout=15.0, what="delay proxy")
            self._proxies[key] = (p, addr)
            return addr

    def added_one_way_s(self, rtt_s: float) -> float:
        """What a delay proxy adds each way for a link of ``rtt_s``: the link's RTT is the whole round trip,
        so the path's own (:meth:`path_rtt_s`) is part of it, not added to it."""
        return max(0.0, rtt_s - self.path_rtt_s()) / 2 if rtt_s > 0 else 0.0

    def path_rtt_s(self) -> float:
        """The round trip of a delayed path with nothing added (measured once, then kept): the host links,
        the bridge, the proxy's relay and both ends' wake-ups, from host 0 to the last host through a
        zero-delay proxy. Subtracted from the configured RTT, so that a link configured at 0.3 ms measures
        0.3 ms (added on top, a "0.3 ms" link measured 0.55 ms on a 2-core VM)."""
        with self._mutex:
            if self._path_rtt_s is None:
                self._path_rtt_s = self._measure_path_rtt()
                print(f"testbed: path round trip {self._path_rtt_s * 1e3:.3f} ms (part of the link's RTT)",
                      file=sys.stderr, flush=True)
            return self._path_rtt_s

    def _measure_path_rtt(self) -> float:
        far = self.hosts[-1]
        server, port = self.probe_server(far.index)
        try:
            addr = self.delayed_address(far.index, port, rtt_s=0.0, proxy=True)
            return self.probe(0, "ping", addr, count=300, max_seconds=3)["rtt_median_ms"] / 1000
        finally:
            self._kill(server)

    # ---- probes (bench.testbed.probe) ------------------------------------

    def probe_server(self, host_index: int) -> tuple[subprocess.Popen, int]:
        """A ping/bulk probe server in host ``host_index`` (on its ip) and its port; kill it when done."""
        host = self.hosts[host_index]
        server = host.popen([sys.executable, "-m", "bench.testbed.probe", "serve", "--listen", f"{host.ip}:0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _, port = _read_ready(server, timeout=15.0, what="probe server")
        return server, port

    def probe(self, host_index: int, mode: str, addr: tuple[str, int], **opts) -> dict:
        """Run the probe client ``mode`` (ping, bulk) in host ``host_index`` against ``addr``: its JSON result."""
        argv = [sys.executable, "-m", "bench.testbed.probe", mode, "--connect", f"{addr[0]}:{addr[1]}"]
        for k, v in opts.items():
            argv += [f"--{k.replace('_', '-')}", str(v)]
        res = self.host(host_index).run(argv, timeout=40)
        if res.returncode != 0:
            raise TestbedError(f"testbed: probe {mode} failed: {res.stderr.strip()[-400:]}")
        return json.loads(res.stdout.strip().splitlines()[-1])

    # ---- processes -------------------------------------------------------

    def _spawn(self, argv: list[str], env: dict[str, str] | None, **kwargs) -> subprocess.Popen:
        if self._closing:
            raise TestbedError("testbed: already torn down")
        kwargs.setdefault("start_new_session", True)
        p = subprocess.Popen(argv, env=_python_env(env), **kwargs)
        self._procs.append(p)
        return p

    @classmethod
    def _kill(cls, p: subprocess.Popen, grace_s: float = 2.0) -> None:
        cls._kill_all([p], grace_s)

    @staticmethod
    def _kill_all(procs: list[subprocess.Popen], grace_s: float = 2.0) -> None:
        """SIGTERM every process group at once, SIGKILL whatever is left after ``grace_s``."""
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            alive = [p for p in procs if p.poll() is None]
            if not alive:
                return
            for p in alive:
                try:
                    os.killpg(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    try:
                        p.send_signal(sig)
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + wait
            for p in alive:
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass

    # ---- building --------------------------------------------------------

    def _netns_unavailable_reason(self) -> str | None:
        if os.geteuid() != 0:
            return "not root"
        if not netns.tools_present():
            return "iproute2 (ip, tc) not installed"
        return None

    def _switch_ns(self) -> str:
        return f"{self.prefix}-sw"

    def _build_netns(self) -> None:
        lock = netns.OwnerLock(self.prefix)
        if not lock.try_acquire():
            raise TestbedBusy(
                f"testbed: prefix {self.prefix!r} is in use by pid {lock.holder()}; "
                "pick another name_prefix")
        self._lock = lock
        for ns in netns.testbed_namespaces(self.prefix):  # stale: we hold the lock
            netns.delete_namespace(ns)
        sh = lambda *a: netns.run(list(a))  # noqa: E731
        sw = self._switch_ns()
        sh("ip", "netns", "add", sw)
        self._namespaces.append(sw)
        sh("ip", "-n", sw, "link", "set", "lo", "up")
        # mcast_snooping 0: flood multicast (mDNS) to every port, no querier needed
        sh("ip", "-n", sw, "link", "add", "br0", "type", "bridge", "mcast_snooping", "0")
        sh("ip", "-n", sw, "addr", "add", f"{SWITCH_IP}/{SUBNET_LEN}", "dev", "br0")
        sh("ip", "-n", sw, "link", "set", "br0", "up")
        ncpu = os.cpu_count() or 1
        for i in range(self.n_hosts):
            ns = f"{self.prefix}-h{i}"
            ip = f"{SUBNET_PREFIX}{i + 1}"
            sh("ip", "netns", "add", ns)
            self._namespaces.append(ns)
            port = f"h{i}"
            sh("ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            sh("ip", "-n", sw, "link", "set", port, "master", "br0", "multicast", "on", "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", ns, "addr", "add", f"{ip}/{SUBNET_LEN}", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "multicast", "on", "up")
            sh("ip", "-n", ns, "route", "add", "224.0.0.0/4", "dev", "eth0")
            link = self.link_of(i)
            if link.shaped:
                sh("tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", *link.tbf_args())  # uplink
                sh("tc", "-n", sw, "qdisc", "add", "dev", port, "root", *link.tbf_args(down=True))  # downlink
            self.hosts.append(Host(i, ip, ns, [i % ncpu], self))

    def _build_loopback(self) -> None:
        ncpu = os.cpu_count() or 1
        self.hosts = [Host(i, f"127.0.0.{i + 1}", None, [i % ncpu], self) for i in range(self.n_hosts)]

    def _teardown_netns(self) -> None:
        # hosts before the switch; deleting a namespace deletes its veth ends
        for ns in sorted(self._namespaces, key=lambda n: n.endswith("-sw")):
            netns.delete_namespace(ns)
        self._namespaces.clear()
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    # ---- signals ---------------------------------------------------------

    def _install_signal_handlers(self) -> None:
        """SIGINT/SIGTERM/SIGHUP become exceptions, so ``__exit__`` tears down."""
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set handlers; atexit still covers exit

        def handler(signum, frame):
            if self._closing:
                return
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, handler)

    def _restore_signal_handlers(self) -> None:
        for sig, old in self._old_handlers.items():
            try:
                signal.signal(sig, old)
            except (ValueError, TypeError):
                pass
        self._old_handlers.clear()


_PROXY_SOURCE = Path(__file__).with_name("delay_proxy.c")
_compiled: list[Path | None] = []


def compiled_delay_proxy() -> Path | None:
    """The compiled delay proxy (built once per source into the user's cache), or None where no C
    compiler builds it: then the Python one (``delay_proxy.py``, the same behaviour at a higher CPU cost
    per chunk) stands in. ``MESHD_TESTBED_PY_PROXY=1`` asks for the Python one."""
    if os.environ.get("MESHD_TESTBED_PY_PROXY") == "1":
        return None
    if _compiled:
        return _compiled[0]
    import hashlib

    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    out = None
    if cc and _PROXY_SOURCE.exists():
        digest = hashlib.sha256(_PROXY_SOURCE.read_bytes()).hexdigest()[:16]
        out = Path.home() / ".cache" / "meshd-testbed" / f"delay_proxy-{digest}"
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_suffix(f".{os.getpid()}.tmp")
            built = subprocess.run([cc, "-O2", "-o", str(tmp), str(_PROXY_SOURCE)], capture_output=True, text=True)
            if built.returncode:
                print(f"testbed: the compiled delay proxy did not build ({built.stderr.strip()[-300:]}); "
                      "the Python one stands in", file=sys.stderr)
                out = None
            else:
                os.replace(tmp, out)
    _compiled.append(out)
    return out


def _read_ready(p: subprocess.Popen, timeout: float, what: str) -> tuple[str, int]:
    """Wait for the child's ``READY host port`` line."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r, _, _ = select.select([p.stdout], [], [], 0.1)
        if r:
            line = p.stdout.readline()
            if line.startswith("READY "):
                _, host, port = line.split()
                return host, int(port)
            if not line:
                break
        elif p.poll() is not None:
            break
    err = ""
    if p.poll() is not None and p.stderr is not None:
        err = p.stderr.read()[-500:]
    raise TestbedError(f"testbed: {what} did not start: {err.strip() or 'timeout'}")
