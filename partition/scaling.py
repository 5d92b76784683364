"""A profile for a device nobody has measured yet: a measured one, scaled.

How a home is planned before every device has run ``meshd profile``: take a measured
profile of the same model and say how fast and how big the other device is
(``scale``), on the command line as ``PATH@speed=0.5,mem=4GiB,id=tablet``
(``parse_profile_arg``, ``parse_size``). The daemon's self-profile scales the shipped
profile by one timed layer the same way.
"""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import datetime, timezone

from partition.profile import DeviceProfile, ProfileError, QGrid, load, memory_budget


def scale(
    profile: DeviceProfile,
    speed_factor: float,
    memory_bytes: int | None = None,
    *,
    device_id: str | None = None,
    headroom: float | None = None,
) -> DeviceProfile:
    """A profile for a device that is ``speed_factor`` times as fast as ``profile``'s.

    All latencies are divided by ``speed_factor`` (0.5 = half as fast), ``b`` and
    the model/memory-per-layer figures are kept, and the memory budget is
    recomputed from ``memory_bytes`` (the new device's total memory) and the
    headroom. This is a first-order model: it assumes the device is uniformly
    faster or slower (same ratio for compute-bound prefill and memory-bound
    decode). Measure the device with ``meshd profile`` once it is available.
    """
    if not speed_factor > 0 or not math.isfinite(speed_factor):
        raise ProfileError(f"speed factor must be a positive number, got {speed_factor}")
    f = 1.0 / speed_factor
    headroom = profile.memory_headroom if headroom is None else headroom
    total = profile.memory_total_bytes if memory_bytes is None else int(memory_bytes)
    prev = profile.scaled_from or {}
    base_factor = float(prev.get("speed_factor", 1.0))
    return replace(
        profile,
        device_id=device_id or f"{profile.device_id}-x{speed_factor:g}",
        layer_latency_s=tuple(tuple(v * f for v in row) for row in profile.layer_latency_s),
        q=QGrid(profile.q.x, profile.q.y,
                tuple(tuple(v * f for v in row) for row in profile.q.seconds)),
        decode_step_s=tuple(v * f for v in profile.decode_step_s),
        message_overhead_s=(None if profile.message_overhead_s is None
                            else profile.message_overhead_s * f),
        memory_total_bytes=total,
        memory_headroom=headroom,
        memory_budget_bytes=memory_budget(total, headroom),
        scaled_from={
            "device_id": prev.get("device_id", profile.device_id),
            "measured_at": prev.get("measured_at", profile.measured_at),
            "speed_factor": base_factor * speed_factor,
            "scaled_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        },
    )


_SIZE_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
               "t": 1e12, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """``"4GiB"`` → 4294967296; ``"512MB"`` → 512000000."""
    t = text.strip().lower().replace(" ", "")
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    try:
        value = float(num)
    except ValueError:
        raise ProfileError(f"cannot read size {text!r} (try 4GiB or 512MB)") from None
    if unit not in _SIZE_UNITS or value < 0:
        raise ProfileError(f"cannot read size {text!r} (try 4GiB or 512MB)")
    return int(value * _SIZE_UNITS[unit])


def parse_profile_arg(arg: str) -> DeviceProfile:
    """``PATH`` or ``PATH@speed=0.5,mem=4GiB,id=tablet`` (scaled on the fly).

    This is how a home is planned before every device has been measured: point
    at a measured profile and say how fast and how big the other device is.
    """
    path, _, opts = arg.partition("@")
    prof = load(path)
    if not opts:
        return prof
    kv = {}
    for part in opts.split(","):
        k, sep, v = part.partition("=")
        if not sep:
            raise ProfileError(f"--profile option {part!r} must be key=value (speed, mem, id)")
        kv[k.strip().lower()] = v.strip()
    unknown = set(kv) - {"speed", "mem", "id", "headroom"}
    if unknown:
        raise ProfileError(f"--profile options {sorted(unknown)} unknown (use speed, mem, id)")
    try:
        speed = float(kv.get("speed", "1"))
        headroom = float(kv["headroom"]) if "headroom" in kv else None
    except ValueError:
        raise ProfileError(f"--profile {arg!r}: speed/headroom must be numbers") from None
    mem = parse_size(kv["mem"]) if "mem" in kv else None
    return scale(prof, speed, mem, device_id=kv.get("id"), headroom=headroom)
