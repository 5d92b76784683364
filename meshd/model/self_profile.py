"""A daemon that has no profile of its own measures itself, in seconds, before it is planned.

Why: a member without a profile is planned from the shipped one, so a home of a
fast laptop and a slow mini PC looks like two equal devices. The slow one gets
half the layers and sets the pace for both: adding it makes answers slower,
the complaint users have of similar tools. A full profile (``meshd profile``)
takes minutes; timing one decoder layer against the shipped profile of the same
model (``meshd.model.profiler.estimate_speed``) gives the device's speed in a
second or two. That is enough for the planner to weigh the devices and to leave
out one that would slow the home down.

The daemon runs this once the model is open and before it counts as loaded, so
the first plan that includes the device already uses its measurement. The result
is kept in the state directory and reused at every start. A profile the user
installs (``meshd profile --install``) for the same model takes precedence.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshd.log import get_logger
from meshd.model.profile_files import as_mode, prefer_mode, profile_model, read_profiles
from meshd.state import StateDir

log = get_logger("meshd.model.self_profile")


@dataclass(frozen=True)
class SelfProfile:
    """What the daemon plans itself with, and how it came by it (shown by ``meshd status``)."""

    profile: dict[str, Any] | None
    how: str  # "installed", "measured", "reused", or "shipped default: <why>"
    path: Path | None = None


def describe(profile: dict[str, Any] | None) -> str:
    """One line on where a member's profile came from, for ``meshd status``."""
    if not profile:
        return "shipped default"
    scaled = profile.get("scaled_from") or {}
    if scaled:
        speed = float(scaled.get("speed_factor") or 0.0)
        return f"{speed:.2f}x {scaled.get('device_id', '?')} (one-layer estimate)"
    return f"measured {str(profile.get('measured_at', ''))[:10]}".rstrip()


def reference_for(model: str, dirs: list[Path], weights: str = "") -> Path | None:
    """A shipped full profile of ``model`` (its identity) to scale from, if any: one measured in the
    numeric mode ``weights`` when there is one (a packed layer's speed is not a float32 layer's)."""
    found = [(path, data) for d in dirs for path, data in read_profiles(d)
             if profile_model(data) == model and not data.get("scaled_from")]
    best = prefer_mode(found, weights, lambda item: item[1])
    return best[0] if best else None


def settle(state: StateDir, source, *, mode: str, threads: int, on_cpu: bool, reference_dirs: list[Path],
           estimate: Callable[..., float] | None = None, weights: str = "") -> SelfProfile:
    """The profile this device should be planned with (blocking: run it in a worker thread).

    ``estimate(source, reference, threads=...)`` returns the device's speed relative to
    the reference profile (default: ``meshd.model.profiler.estimate_speed``).
    """
    model = getattr(source, "identity", None) or ""
    own = state.own_profile(model) if model else None
    if own is not None and weights and own.get("dtype") not in (weights, None) and mode != "off":
        own = None  # measured in another numeric mode: measure again in this one
    if own is not None:
        return SelfProfile(own, "installed" if not own.get("scaled_from") else "reused")
    if mode == "off":
        return SelfProfile(None, "shipped default: self-profiling is off (self_profile = off)")
    if not on_cpu:
        return SelfProfile(None, "shipped default: profiles measure the CPU only and this stage runs on a GPU")
    ref_path = reference_for(model, reference_dirs, weights)
    if ref_path is None:
        return SelfProfile(None, "shipped default: no shipped profile of this model to scale; "
                                 "run 'meshd profile --install' for a full one")
    from meshd.model.profiler import estimate_speed
    from partition import profile as pf
    from partition.machine import default_device_id, total_memory_bytes
    from partition.scaling import scale

    reference = pf.load(ref_path)
    if weights and reference.dtype != weights and weights in pf.DTYPE_BYTES:
        # a reference measured in another mode (the gguf mode has packed ones): time this device in
        # its own mode against it, and size its KV cache for that mode (meshd.model.profile_files.as_mode)
        reference = pf.DeviceProfile.from_dict(as_mode(reference.to_dict(), weights))
    # the wall clock by default: what this device serves at, quotas and all (see estimate_speed)
    estimate = estimate or functools.partial(estimate_speed, clock=time.perf_counter)
    speed = estimate(source, reference, threads=threads)
    device_id = default_device_id(threads)
    prof = scale(reference, speed, total_memory_bytes(), device_id=device_id)
    prof = dataclasses.replace(prof, threads=threads)
    path = pf.save(prof, state.profiles_dir / f"self-{device_id}-{model.rpartition('@')[2] or 'model'}.json")
    log.info("self_profile_measured", speed=round(speed, 3), reference=reference.device_id, threads=threads,
             path=str(path))
    return SelfProfile(prof.to_dict(), "measured", path)
