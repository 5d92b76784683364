"""How one value of the status prints: durations, sizes, layer ranges, ages, round trips, tables.

Every cell tolerates a missing or unexpected value (it prints ``-`` or the
value as it is): the daemon's status grows over time, and an old CLI must
still print a new daemon's status.
"""

from __future__ import annotations

import json
from typing import Any

DASH = "-"


def table(header: list[str], rows: list[list[str]], indent: str = "") -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = lambda r: indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return [fmt(header), *(fmt(r) for r in rows)]


def member_name(m: dict[str, Any], names: list[Any]) -> str:
    """The device's name; with its node id when another member has the same name."""
    name = m.get("name") or m.get("node_id")
    if names.count(name) > 1 and m.get("node_id") and name != m.get("node_id"):
        return f"{name} ({m['node_id']})"
    return text(name)


def duration(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return text(v)
    if v < 120:
        return f"{v:.0f}s"
    if v < 7200:
        return f"{v / 60:.0f}m"
    if v < 2 * 86400:
        return f"{v / 3600:.1f}h"
    return f"{v / 86400:.1f}d"


def text(v: Any) -> str:
    return DASH if v is None or v == "" else str(v)


def model(m: Any) -> str:
    if isinstance(m, dict):
        return text(m.get("id") or m.get("name") or json.dumps(m, sort_keys=True))
    return text(m) if m else "none loaded"


def memory(m: dict[str, Any]) -> str:
    """The member's memory budget; ``memory_budget`` is in MiB, as the daemon reports it."""
    if m.get("memory_budget_bytes") is not None:
        return data_size(m["memory_budget_bytes"])
    mb = m.get("memory_budget_mb", m.get("memory_budget"))
    if isinstance(mb, (int, float)) and not isinstance(mb, bool):
        return data_size(mb * (1 << 20))
    return text(mb)


def data_size(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return text(v)
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(v) >= size:
            return f"{v / size:.1f} {unit}"
    return f"{int(v)} B"


def layers(v: Any) -> str:
    """Half-open ``[first, end)`` pairs print as ``[first,end)``, as ``--json``, the plan and the demo
    write them (an inclusive ``first-(end-1)`` beside a JSON ``[first, end]`` read as two different
    splits); several ranges join with commas."""
    if v is None or v == [] or v == "":
        return DASH
    if isinstance(v, dict):
        v = [v.get("first"), v.get("end", v.get("last"))]
    if isinstance(v, (list, tuple)):
        if len(v) == 2 and all(isinstance(x, int) for x in v):
            return f"[{v[0]},{v[1]})" if v[1] > v[0] else DASH
        if all(isinstance(x, (list, tuple, dict)) for x in v):
            return ",".join(layers(x) for x in v)
    return str(v)


def ago(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return text(v)
    if v < 1:
        return "now"
    if v < 120:
        return f"{v:.0f}s ago"
    if v < 7200:
        return f"{v / 60:.0f}m ago"
    return f"{v / 3600:.0f}h ago"


def rtt(link: Any) -> str:
    """The control link's last round trip to a member, or "unreachable" once it stopped answering."""
    if not isinstance(link, dict):
        return DASH
    seconds = link.get("rtt_s")
    if isinstance(seconds, (int, float)) and not isinstance(seconds, bool):
        return f"{seconds * 1000:.1f} ms"
    stopped = link.get("failures") or link.get("age_s") is not None  # failed, or answered long ago
    return "unreachable" if link.get("reachable") is False and stopped else DASH
