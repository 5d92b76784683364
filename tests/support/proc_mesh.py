"""Emulate a mesh on one machine: bare stage processes pinned to cores + an in-process coordinator.

Benchmarks and multi-process tests use this to run the real stage service and
transport (CURVE on by default) across OS processes, each pinned to its own
core(s) with its own torch thread count, without discovery or pairing. A
``launcher`` hook lets the testbed start each process inside a network
namespace instead (with :func:`stage_env`, so the stage module resolves).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from meshd.pipeline.coordinator.service import PipelineCoordinator
from meshd.pipeline.route import GroupSeat, Route, StageEndpoint
from tests.support.repo import ROOT

Launcher = Callable[[int, list[str]], subprocess.Popen]


def stage_env() -> dict[str, str]:
    """This environment, with the repository first on PYTHONPATH: ``python -m tests.support.stage_proc``
    then resolves to this checkout wherever the harness was started from."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class ProcessMesh:
    ranges: list[tuple[int, int]]
    model: str | None = None
    cores: list[list[int]] | None = None  # per stage; default: stage i on core i % ncpu
    threads: int = 1
    curve: bool = True
    activation_dtype: str | None = None
    hosts: list[str] | None = None  # per stage bind host (testbed namespaces); default loopback
    coordinator_host: str = "127.0.0.1"
    launcher: Launcher | None = None
    # (stage index, or -1 for the coordinator; host; port) -> the address peers dial; a
    # testbed returns a delay proxy here so links get their round-trip time
    reach: Callable[[int, str, int], tuple[str, int]] | None = None
    heads: str | None = None  # Medusa heads for the last stage (None: shipped; "none": off)
    exit_heads: str | None = None  # early-exit heads for the last stage (None: shipped; "none": off)
    max_batch_tokens: int | None = None  # per batched forward (None: the stage's default; 0: unbatched)
    weights: str | None = None  # each stage's numeric mode (None: the stage process's default, float32)
    device: str | None = None  # each stage's device ("cuda" puts every stage on the GPU; None: the CPU)
    ready_timeout_s: float = 180.0
    progress_every_s: float | None = None  # how often a long pass reports progress (None: the stage's default)
    slow_layers: float = 1.0  # every stage's layers take this many times as long as they compute
    # the coordinator starts requests on the prefix the stages hold (as a daemon does); False: every
    # request is prefilled in full (the stages keep nothing they are asked to reuse)
    prefix_cache: bool = True
    # devices per route, in order (None: one pipeline over every stage; [1, 1]: two replicas, whose
    # ``ranges`` each cover every layer); the coordinator routes each request
    # (meshd.pipeline.coordinator.routes)
    groups: list[int] | None = None
    # every stage process is a member of one tensor group holding ``ranges[0]`` (all ``ranges`` equal), with
    # the attention held this way (partition.tensor_split.ATTENTIONS); None: no group. Needs gguf weights.
    tensor: str | None = None
    procs: list[subprocess.Popen] = field(default_factory=list)
    stats: list[dict] = field(default_factory=list)

    async def __aenter__(self) -> "ProcessMesh":
        from transport.keys import AllowList, load_or_create_keypair
        from transport.node import TransportNode

        self.root = Path(tempfile.mkdtemp(prefix="meshd-procmesh-"))
        n = len(self.ranges)
        ncpu = os.cpu_count() or 1
        names = [f"dev{i}" for i in range(n)] + ["coord"]
        self.dirs = dirs = {nm: self.root / nm for nm in names}
        keys = {}
        for nm, d in dirs.items():
            d.mkdir()
            keys[nm] = load_or_create_keypair(d).public.decode() if self.curve else ""
        if self.curve:
            for d in dirs.values():
                allow = AllowList.for_state_dir(d)
                for nm, k in keys.items():
                    allow.add(k, nm)
        hosts = self.hosts or ["127.0.0.1"] * n
        reach = self.reach or (lambda i, host, port: (host, port))
        binds, stages = [], []
        for i, (a, b) in enumerate(self.ranges):
            port = 7600 + i if self.hosts else free_port()
            binds.append(f"tcp://{hosts[i]}:{port}")
            rip, rport = reach(i, hosts[i], port)
            stages.append(StageEndpoint(f"dev{i}", f"tcp://{rip}:{rport}", keys[f"dev{i}"], a, b))
        stages = tuple(stages)
        if self.tensor:
            stages = (self._group_stage(stages, hosts),)
            self.group_binds = [s.address for s in stages[0].group]
        groups = self.groups or [len(stages)]
        assert sum(groups) == len(stages), "groups must add up to the stages"
        self.routes, k = [], 0
        for index, size in enumerate(groups):
            self.routes.append(Route(1, stages[k:k + size], index=index))
            k += size
        self.route = self.routes[0]
        coord_port = free_port(self.coordinator_host)
        coord_bind = f"tcp://{self.coordinator_host}:{coord_port}"
        cip, cport = reach(-1, self.coordinator_host, coord_port)
        coord_addr = f"tcp://{cip}:{cport}"
        route_files = {}
        for route in self.routes:
            route_files[route.index] = self.root / f"route{route.index}.json"
            route_files[route.index].write_text(json.dumps({
                "plan_version": 1, "index": route.index, "stages": [dataclasses.asdict(s) for s in route.stages],
                "directory": {"coord": [coord_addr, keys["coord"]]}}))
        self.node = TransportNode("coord", state_dir=dirs["coord"], curve=self.curve)
        await self.node.start()
        directory = {s.node_id: (s.address, s.public_key) for s in stages}
        in_route = {st.node_id: r.index for r in self.routes for st in r.stages}
        self.coord = PipelineCoordinator(self.node, "coord", directory.__getitem__, token_timeout_s=300,
                                         activation_dtype=self.activation_dtype, prefix_cache=self.prefix_cache)
        await self.coord.start(coord_bind)
        self.coord.address = coord_addr  # what the last stage dials (maybe through a delay proxy)
        for i in range(n):
            node_id = f"dev{i}"
            cores = self.cores[i] if self.cores else [i % ncpu]
            argv = [sys.executable, "-m", "tests.support.stage_proc", "--node-id", node_id,
                    "--state-dir", str(dirs[node_id]), "--bind", binds[i],
                    "--route", str(route_files[in_route.get(node_id, 0)]),
                    "--threads", str(self.threads), "--cores", ",".join(map(str, cores))]
            if self.tensor:
                argv += ["--group-bind", self.group_binds[i]]
            if self.model:
                argv += ["--model", str(self.model)]
            if self.activation_dtype:
                argv += ["--activation-dtype", self.activation_dtype]
            if not self.curve:
                argv.append("--no-curve")
            if self.heads:
                argv += ["--heads", self.heads]
            if self.exit_heads:
                argv += ["--exit-heads", self.exit_heads]
            if self.max_batch_tokens is not None:
                argv += ["--max-batch-tokens", str(self.max_batch_tokens)]
            if self.weights:
                argv += ["--weights", self.weights]
            if self.device:
                argv += ["--device", self.device]
            if self.slow_layers != 1.0:
                argv += ["--slow-layers", str(self.slow_layers)]
            if self.progress_every_s is not None:
                argv += ["--progress-every", str(self.progress_every_s)]
            p = (self.launcher(i, argv) if self.launcher else
                 subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True, env=stage_env()))
            self.procs.append(p)
        deadline = time.monotonic() + self.ready_timeout_s
        for p in self.procs:
            line = ""
            while not line.startswith("READY"):
                if time.monotonic() > deadline or p.poll() is not None:
                    await self.__aexit__(None, None, None)
                    raise RuntimeError(f"stage process {p.args[4]} did not become ready")
                line = p.stdout.readline().strip()
        self.coord.set_routes(tuple(self.routes))
        for route in self.routes:
            await self.coord.wait_ready(route)
        return self

    def _group_stage(self, stages: tuple[StageEndpoint, ...], hosts: list[str]) -> StageEndpoint:
        """One stage held by every process as a tensor group of equal speeds, led by ``dev0``."""
        assert len(set(self.ranges)) == 1, "a tensor group's members hold the same layers"
        assert self.reach is None and self.hosts is None, "a tensor group's links are on loopback here"
        seats = tuple(GroupSeat(s.node_id, f"tcp://{hosts[i]}:{free_port(hosts[i])}", s.public_key)
                      for i, s in enumerate(stages))
        return dataclasses.replace(stages[0], group=seats, group_speeds=(1.0,) * len(seats),
                                   group_attention=self.tensor)

    async def stage_status(self, timeout_s: float = 10.0) -> list[dict]:
        """Every stage process's status now, in stage order (each writes it on SIGUSR1; see stage_proc)."""
        from tests.support.stage_proc import STATUS_FILE

        files = [self.dirs[f"dev{i}"] / STATUS_FILE for i in range(len(self.procs))]

        def serial(f: Path) -> int:
            try:
                return json.loads(f.read_text())["serial"]
            except (OSError, ValueError, KeyError):
                return 0

        before = [serial(f) for f in files]
        for p in self.procs:
            os.killpg(p.pid, signal.SIGUSR1)  # each stage leads its own process group
        deadline = time.monotonic() + timeout_s
        while any(serial(f) <= b for f, b in zip(files, before)):
            if time.monotonic() > deadline:
                late = [str(f.parent.name) for f, b in zip(files, before) if serial(f) <= b]
                raise RuntimeError(f"stage processes {late} did not report their status within {timeout_s}s")
            await asyncio.sleep(0.01)  # sleep-ok: polls files the stage processes write on SIGUSR1
        return [json.loads(f.read_text())["status"] for f in files]

    async def reused_tokens(self) -> int:
        """Prompt positions the stages have not computed because a cached prefix held them, all stages
        added (each stage counts its own positions)."""
        return sum(s.get("prefix_cache", {}).get("reused_tokens", 0) for s in await self.stage_status())

    async def __aexit__(self, *exc) -> None:
        await self.coord.close()
        await self.node.close()
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                out, _ = p.communicate(timeout=10)
                for line in (out or "").splitlines():
                    if line.startswith("{"):
                        self.stats.append(json.loads(line).get("stats", {}))
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(self.root, ignore_errors=True)
