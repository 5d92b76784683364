"""``meshd profile``: measure this device for the planner, or scale a profile for another.

Measuring writes ``profiles/<device-id>.json`` (progress bar on stderr) and is
skipped when that file already holds a profile of the same model with the
same settings and torch version (``--force`` re-measures). ``--scale-from``
writes a profile for a device that has not been measured yet from a measured
one and the new device's relative speed and memory; ``--quick-from`` finds that
speed by timing a single layer here (seconds instead of a minute).

A profile records what it measured in ``host["device"]`` (``kind``: cpu). Only
the CPU can be measured so far: the profiler times with the CPU clock and budgets
host memory, which on a GPU would describe the kernel launches, not the device.
On a machine whose daemon computes on its GPU (``meshd join --device auto``),
the CPU profile makes the planner see it as its CPU — conservative, not wrong.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "profile",
        help="measure this device's per-layer latencies and memory for the planner",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: embedded model)")
    p.add_argument("--device-id", default=None,
                   help="profile name (default: <machine>-<cores>core-<threads>thread)")
    p.add_argument("--threads", type=int, default=1, help="torch threads to measure with (default 1)")
    p.add_argument("--device", default="cpu",
                   help="device to measure: cpu (default); measuring a GPU (cuda, cuda:N, auto on a CUDA "
                        "machine) is not built yet and is refused")
    p.add_argument("--max-seq", type=int, default=2048, help="longest sequence profiled (default 2048)")
    p.add_argument("--weights", default="float32", choices=["float32", "bfloat16", "float16", "packed", "packed4", "gguf"],
                   help="numeric mode to measure in (default float32; a daemon plans with the one it serves in)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per grid point (median)")
    p.add_argument("--headroom", type=float, default=None,
                   help="share of memory left to the rest of the device (default 0.25)")
    p.add_argument("--memory", default=None, metavar="SIZE",
                   help="total memory to plan with instead of the device's (e.g. 4GiB)")
    p.add_argument("--out-dir", default="profiles", help="directory for <device-id>.json")
    p.add_argument("-o", "--output", default=None, help="exact output file (overrides --out-dir)")
    p.add_argument("--force", action="store_true", help="measure even if a matching profile exists")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--scale-from", default=None, metavar="PROFILE",
                   help="do not measure: derive a profile from this one (with --speed, --memory)")
    p.add_argument("--quick-from", default=None, metavar="PROFILE",
                   help="measure one layer only (seconds) and scale this reference profile by the "
                        "speed ratio found")
    p.add_argument("--speed", type=float, default=None,
                   help="with --scale-from: the new device's speed relative to the measured one")
    p.add_argument("--install", action="store_true",
                   help="also copy the profile into this device's daemon state (shared with the home)")
    p.add_argument("--state-dir", default=None, help="with --install: the daemon's state directory")
    p.add_argument("--config", type=Path, default=None, help="with --install: TOML config file")
    p.add_argument("--json", action="store_true", help="print one JSON summary as the last line")
    p.set_defaults(func=run)


def _install(args, path: Path) -> None:
    """Copy to ``<state dir>/profiles/``, where the daemon looks for its own profile."""
    if not args.install:
        return
    import os
    import shutil

    from meshd.config import load_config
    from meshd.state import StateDir

    cfg = load_config(args.config, os.environ, {"state_dir": args.state_dir})
    state = StateDir(cfg.resolved_state_dir()).ensure()
    dest = state.profiles_dir / path.name
    if dest.resolve() != path.resolve():
        shutil.copyfile(path, dest)
    print(f"installed {dest} (the daemon shares it with the home on its next start or re-plan)")


def _target(args, device_id: str) -> Path:
    return Path(args.output) if args.output else Path(args.out_dir) / f"{device_id}.json"


def _summary(prof, path: Path, reused: bool) -> dict:
    return {
        "path": str(path),
        "device_id": prof.device_id,
        "model": prof.model.identity,
        "reused": reused,
        "threads": prof.threads,
        "min_chunk": prof.min_chunk,
        "full_model_s_at_max_seq": prof.full_model_time(prof.calib_seq_lens[-1]),
        "decode_step_s": list(prof.decode_step_s),
        "memory_budget_bytes": prof.memory_budget_bytes,
        "q_max_abs_rel_error": prof.q_error.get("max_abs_rel_error"),
        "profile_seconds": prof.host.get("profile_seconds"),
        "scaled_from": prof.scaled_from,
        "device": measured_kind(prof),
    }


def measured_kind(prof) -> str:
    """The device kind a profile measured (profiles from before the field existed measured the CPU)."""
    return str((prof.host.get("device") or {}).get("kind", "cpu"))


def _measurable_device(spec: str):
    """The device to measure, or one clear line on why it cannot be measured yet."""
    from decoding.device import resolve_device
    from meshd.errors import MeshdError

    device = resolve_device(spec)
    if device.type != "cpu":
        raise MeshdError(f"--device {spec}: measuring a GPU ({device}) is not built yet: the profiler times with "
                         f"the CPU clock and budgets host memory; profile with --device cpu (the planner then "
                         f"treats this device as its CPU)")
    return device


def run(args) -> int:
    from meshd.errors import MeshdError
    from partition import profile as pf
    from partition.scaling import parse_size, scale

    memory = parse_size(args.memory) if args.memory else None
    if args.headroom is not None and not 0 <= args.headroom < 1:
        raise MeshdError("--headroom must be a fraction in [0, 1)")

    if args.scale_from:
        if args.speed is None:
            raise MeshdError("--scale-from needs --speed (the device's speed relative to the profile)")
        src = pf.load(args.scale_from)
        prof = scale(src, args.speed, memory, device_id=args.device_id, headroom=args.headroom)
        path = pf.save(prof, _target(args, prof.device_id))
        print(f"wrote {path}: {prof.device_id} = {src.device_id} x{args.speed:g} speed, "
              f"memory budget {prof.memory_budget_bytes / 2**30:.1f} GiB")
        _install(args, path)
        if args.json:
            print(json.dumps(_summary(prof, path, False)))
        return 0
    if args.speed is not None:
        raise MeshdError("--speed only applies with --scale-from")
    from decoding.device import describe_device

    device = _measurable_device(args.device)
    measured_on = {"device": describe_device(device)}
    if args.threads < 1:
        raise MeshdError("--threads must be >= 1")
    if args.threads < 1 or args.max_seq < 16 or args.repeats < 1:
        raise MeshdError("--threads and --repeats must be >= 1 and --max-seq >= 16")

    from meshd.model.store import open_model
    from meshd.model.profiler import estimate_speed, profile_device, reusable
    from partition.machine import default_device_id, total_memory_bytes
    from partition.profile_settings import ProfileSettings

    if args.quick_from:
        ref = pf.load(args.quick_from)
        source = open_model(args.model)
        speed = estimate_speed(source, ref, threads=args.threads, repeats=args.repeats)
        device_id = args.device_id or default_device_id(args.threads)
        prof = scale(ref, speed, memory if memory is not None else total_memory_bytes(),
                     device_id=device_id, headroom=args.headroom)
        prof = dataclasses.replace(prof, threads=args.threads, host={**prof.host, **measured_on})
        path = pf.save(prof, _target(args, device_id))
        print(f"wrote {path}: one layer measured, {speed:.2f}x the speed of {ref.device_id}; "
              f"run without --quick-from for a full profile")
        _install(args, path)
        if args.json:
            print(json.dumps(_summary(prof, path, False)))
        return 0

    settings = ProfileSettings(
        max_seq=args.max_seq, threads=args.threads, repeats=args.repeats, dtype=args.weights,
        headroom=pf.DEFAULT_HEADROOM if args.headroom is None else args.headroom,
        memory_bytes=memory,
    )
    device_id = args.device_id or default_device_id(args.threads)
    path = _target(args, device_id)
    source = open_model(args.model)
    if path.exists() and not args.force:
        try:
            existing = pf.load(path)
        except pf.ProfileError:
            existing = None
        if (existing is not None and reusable(existing, source.identity, settings)
                and measured_kind(existing) == device.type):
            print(f"re-using {path} (same model, settings and torch; --force to measure again)")
            _install(args, path)
            if args.json:
                print(json.dumps(_summary(existing, path, True)))
            return 0
    prof = profile_device(source, settings, device_id=device_id,
                          progress=not args.no_progress)
    prof = dataclasses.replace(prof, host={**prof.host, **measured_on})
    pf.save(prof, path)
    print(f"wrote {path} in {prof.host['profile_seconds']:.0f} s: b={prof.min_chunk}, "
          f"whole model at {prof.calib_seq_lens[-1]} tokens {prof.full_model_time(prof.calib_seq_lens[-1]):.2f} s, "
          f"decode step {prof.decode_step_s[0] * 1e3:.1f} ms, q interpolation error "
          f"max {prof.q_error['max_abs_rel_error'] * 100:.1f}%")
    _install(args, path)
    if args.json:
        print(json.dumps(_summary(prof, path, False)))
    return 0
