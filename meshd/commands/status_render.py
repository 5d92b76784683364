"""``meshd status`` as a person reads it: a pure function of the daemon's status dict.

Header, the device table, the plan, recent speed, then a line for each room
with something to say (:mod:`meshd.commands.status_extras`), where the API
listens, and devices seen but not admitted. Missing keys are tolerated: the
daemon's status grows over time, and an old CLI must still print a new
daemon's status.
"""

from __future__ import annotations

from typing import Any

from meshd.commands import status_cells as cell
from meshd.commands import status_extras as extras


def render_status(s: dict[str, Any]) -> str:
    """The human-readable status: header, device table, plan, performance, extras."""
    lines: list[str] = []
    head = "meshd"
    home = s.get("home")
    if isinstance(home, dict):
        home = home.get("name")
    if home:
        head += f" - home {home}"
    if s.get("name") or s.get("node_id"):
        me = s.get("name") or s.get("node_id")
        head += f", this node {me}" + (f" ({s['node_id']})" if s.get("name") and s.get("node_id") else "")
    if s.get("state"):
        head += f", {s['state']}"
    if s.get("version"):
        head += f", meshd {s['version']}"
    if isinstance(s.get("uptime_s"), (int, float)):
        head += f", up {cell.duration(s['uptime_s'])}"
    lines.append(head)
    lines.append(f"model: {cell.model(s.get('model'))}")
    lines.append("")

    members = [m for m in (s.get("members") or []) if isinstance(m, dict)]
    names = [m.get("name") or m.get("node_id") for m in members]
    links = s.get("links") if isinstance(s.get("links"), dict) else {}
    rows = [
        [
            cell.member_name(m, names) + (" *" if m.get("self") else ""),
            cell.text(m.get("state")),
            cell.text(m.get("address")),
            cell.memory(m),
            cell.layers(m.get("layers")),
            cell.text(m.get("kv_tokens")),
            cell.duration(m.get("uptime_s")),
            cell.text(m.get("version")),
            cell.text(m.get("model_digest")),
            cell.ago(m.get("last_seen_s")),
            cell.DASH if m.get("self") else cell.rtt(links.get(m.get("node_id"))),
        ]
        for m in members
    ]
    if rows:
        lines += cell.table(["NAME", "STATE", "ADDRESS", "MEMORY", "LAYERS", "KV TOKENS", "UPTIME",
                         "VERSION", "MODEL", "LAST SEEN", "RTT"], rows)
        by_id = {m.get("node_id"): cell.member_name(m, names) for m in members}
        for n in s.get("not_planned") or []:
            if isinstance(n, dict) and n.get("reason"):
                who = by_id.get(n.get("node_id")) or cell.text(n.get("name") or n.get("node_id"))
                lines.append(f"not planned: {who}: {n['reason']}")
        errors = [(cell.member_name(m, names), m["last_error"]) for m in members if m.get("last_error")]
        for name, err in errors:
            lines.append(f"last error on {name}: {err}")
        for host, sharing in _same_host(members, names).items():
            lines.append(f"one machine: {', '.join(sharing)} run on {host}; each lends the memory shown from the "
                         f"same RAM (give each --memory-budget-mb so together they fit)")
        speeds = [f"{cell.member_name(m, names)}: {m['profile']}" for m in members if m.get("profile")]
        if speeds:
            lines.append("planned with profiles: " + "; ".join(speeds))
        how = s.get("profile")
        if isinstance(how, str) and how.startswith("shipped default:"):
            lines.append(f"this device's profile: {how}")
        if isinstance(s.get("numeric_mode"), str):
            lines.append(f"this device's numeric mode: {s['numeric_mode']}")
    else:
        lines.append("no devices in the mesh yet")
    lines.append("")

    lines.append(_plan(s.get("plan")))
    lines.append(_performance(s.get("recent"), s.get("requests_in_flight")))
    spec = extras.speculation_line(s.get("stage"))
    if spec:
        lines.append(spec)
    outline = extras.outline_line(s.get("stage"))
    if outline:
        lines.append(outline)
    prefix = extras.prefix_line(s.get("stage"))
    if prefix:
        lines.append(prefix)
    exits = extras.exits_line(s.get("stage"))
    if exits:
        lines.append(exits)
    cloud = extras.cloud_line(s.get("stage"))
    if cloud:
        lines.append(cloud)
    names = {m.get("node_id"): m.get("name") or m.get("node_id") for m in members if isinstance(m, dict)}
    lines += extras.sharing_lines(s.get("sharing"), names)

    ifaces = s.get("interfaces")
    if ifaces:
        lines.append("advertising on: " + ", ".join(_iface(i) for i in ifaces))
    api = s.get("api")
    if isinstance(api, dict) and api:
        lines.append("api: " + ", ".join(f"{k} {v}" for k, v in sorted(api.items())))

    seen = [n for n in (s.get("not_admitted") or []) if isinstance(n, dict)]
    if seen:
        lines.append("")
        lines.append("seen on the network but not admitted:")
        lines += cell.table(
            ["NAME", "ADDRESS", "REASON"],
            [[cell.text(n.get("name")), cell.text(n.get("address")), cell.text(n.get("reason"))] for n in seen],
            indent="  ",
        )
    return "\n".join(lines).rstrip() + "\n"


def _same_host(members: list[dict[str, Any]], names: list[Any]) -> dict[str, list[str]]:
    """Hosts that several members' addresses share: daemons on one machine, each of which reports
    the memory it lends as if the machine were its own."""
    by_host: dict[str, list[str]] = {}
    for m in members:
        addr = m.get("address")
        if isinstance(addr, str) and ":" in addr:
            by_host.setdefault(addr.rsplit(":", 1)[0].strip("[]"), []).append(cell.member_name(m, names))
    return {h: who for h, who in by_host.items() if len(who) > 1}


def _plan(p: Any) -> str:
    if not p:
        return "plan: none (no plan fits the devices in the mesh yet)"
    if not isinstance(p, dict):
        return f"plan: {p}"
    parts = [f"plan v{cell.text(p.get('version'))}"]
    stages = p.get("stages")
    if isinstance(stages, list):
        routes = {st.get("route", 0) for st in stages if isinstance(st, dict)}
        if p.get("layout") and p.get("layout") != "pipeline":
            parts.append(f"layout {p['layout']} ({len(routes)} routes)")
        parts.append(f"{len(stages)} stage{'s' if len(stages) != 1 else ''}")
        for st in stages:
            group = st.get("tensor_group") if isinstance(st, dict) else None
            if isinstance(group, list) and group:
                parts.append(f"tensor group {'+'.join(cell.text(n) for n in group)} "
                             f"holds layers {cell.text(st.get('layers'))}")
    elif stages is not None:
        parts.append(f"{stages} stages")
    if p.get("weights"):
        parts.append(f"numeric mode {p['weights']}")
    b = p.get("predicted_bottleneck")
    if b is not None:
        if isinstance(b, dict):
            b = ", ".join(f"{k} {v}" for k, v in b.items())
        elif isinstance(b, (int, float)) and not isinstance(b, bool):
            # seconds the slowest stage takes for one prefill of N prompt tokens (the planner's
            # objective), not a per-token time
            n = p.get("predicted_bottleneck_for_tokens")
            b = f"{b:.2f} s per {n}-token prompt" if n else f"{b:.2f} s"
        parts.append(f"predicted bottleneck: {b}")
    if p.get("leader"):
        parts.append(f"leader {p['leader']}")
    if p.get("reason"):
        parts.append(f"reason: {p['reason']}")
    return ", ".join(parts)


def _performance(recent: Any, in_flight: Any) -> str:
    recent = recent if isinstance(recent, dict) else {}
    tps, ttft = recent.get("tokens_per_s"), recent.get("ttft_s")
    parts = [
        f"{tps:.1f} tokens/s" if isinstance(tps, (int, float)) else "tokens/s -",
        f"TTFT {ttft:.2f} s" if isinstance(ttft, (int, float)) else "TTFT -",
    ]
    n = recent.get("requests")
    if isinstance(n, int):
        parts.append(f"over the last {n} request{'s' if n != 1 else ''}")
    text = "recent: " + ", ".join(parts)
    if in_flight is not None:
        text += f"; {in_flight} in flight"
    return text


def _iface(i: Any) -> str:
    if isinstance(i, dict):
        name = i.get("name") or cell.DASH
        addrs = i.get("addresses") or i.get("address")
        if isinstance(addrs, list):
            addrs = " ".join(map(str, addrs))
        return f"{name} ({addrs})" if addrs else str(name)
    return str(i)
