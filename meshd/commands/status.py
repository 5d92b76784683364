"""``meshd status``: who is in the mesh, what each device runs, how fast it goes.

Reads ``GET /v1/mesh/status`` from the local daemon, found by ``--socket``, or
by the socket its state directory records (``--state-dir`` or ``$MESHD_HOME``:
the same directory every other command is given). The renderer is a pure
function of the status dict and tolerates missing keys, because the daemon's
status grows over time and an old CLI must still print a new daemon's status.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from meshd.client import MeshdClient
from meshd.errors import MeshdError
from meshd.paths import STATE_DIR_HELP
from meshd.readiness import not_ready_reason

DASH = "-"


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "status", help="show the mesh: devices, layers, plan, speed",
        description="Show the local daemon's view of the mesh.",
    )
    p.add_argument("--socket", help="daemon socket (default: $MESHD_SOCKET, $RUNTIME_DIRECTORY, "
                                    "$XDG_RUNTIME_DIR/meshd/meshd.sock)")
    p.add_argument("--state-dir", default=None,
                   help=f"find the daemon by the socket it records in its {STATE_DIR_HELP}")
    p.add_argument("--json", action="store_true", help="print the raw status as JSON")
    p.add_argument("--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
                   help="refresh every SECONDS (default 2) until Ctrl-C")
    p.add_argument("--wait", type=float, default=None, metavar="SECONDS",
                   help="first wait, up to SECONDS, until the daemon answers (for scripts that start "
                        "one in the background); exit 1 if it does not")
    p.add_argument("--ready", action="store_true",
                   help="with --wait: until it is also ready to serve requests (what systemd's READY=1 "
                        "means: model loaded, a plan warm)")
    p.add_argument("--stages", type=int, default=None, metavar="N",
                   help="with --wait: until the plan also gives layers to at least N devices")
    p.set_defaults(func=run)


def wait_for_daemon(client: MeshdClient, timeout_s: float, ready: bool = False, stages: int = 0,
                    interval_s: float = 0.25) -> dict[str, Any]:
    """The daemon's status once it answers (with ``ready``: once it says it is ready to serve;
    with ``stages``: once its plan gives layers to that many devices); a MeshdError naming what it
    still waits for, or why it cannot be asked, when ``timeout_s`` passes first. Lets a script
    start daemons in the background and go on when they can answer, without guessing a sleep."""
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    while True:
        try:
            status = client.status()
            plan = status.get("plan") or {}
            spans = len(plan.get("stages") or [])
            if (status.get("ready") or not ready) and spans >= stages:
                return status
            last = (f"model {status.get('load_state', '?')}, "
                    + (f"plan v{plan.get('version')} over {spans} device(s)" if status.get("ready")
                       else not_ready_reason(status)))
        except MeshdError as exc:  # not listening yet: it may still be starting
            last = str(exc)
        if time.monotonic() >= deadline:
            want = "answering" + (", ready" if ready else "") + (f", over {stages} devices" if stages else "")
            raise MeshdError(f"the daemon is not yet {want} after {timeout_s:g} s ({last})")
        time.sleep(interval_s)


def daemon_socket(socket: str | None, state_dir: str | None, env=None) -> Path | None:
    """The socket to ask: ``--socket``; else the one the daemon of ``--state-dir`` records in its
    ``daemon.json`` (an error if that directory holds no home or no running daemon); else, with
    ``$MESHD_HOME`` set and no ``$MESHD_SOCKET``, the one recorded there if any; else None (the
    default path, ``meshd.paths``)."""
    from meshd.state import RUNTIME_FILE, StateDir

    env = os.environ if env is None else env
    if socket:
        return Path(socket).expanduser()
    if state_dir:
        state = StateDir.of_home(Path(state_dir).expanduser())
    elif env.get("MESHD_HOME") and not env.get("MESHD_SOCKET"):
        state = StateDir(Path(env["MESHD_HOME"]).expanduser())
    else:
        return None
    try:
        return Path(json.loads((state.root / RUNTIME_FILE).read_text())["socket"])
    except (OSError, ValueError, KeyError, TypeError):
        if state_dir:
            raise MeshdError(f"no meshd daemon is running with state directory {state.root} "
                             f"(no readable {RUNTIME_FILE}); start it, or pass --socket") from None
        return None


def run(args) -> int:
    client = MeshdClient(daemon_socket(args.socket, args.state_dir), timeout=10.0)
    if (args.ready or args.stages) and args.wait is None:
        raise MeshdError("--ready and --stages go with --wait SECONDS (how long to wait)")
    if args.wait is not None:
        wait_for_daemon(client, args.wait, ready=args.ready, stages=args.stages or 0)
    if args.watch is None:
        print(_show(client.status(), args.json))
        return 0
    interval = max(args.watch, 0.2)
    clear = "\x1b[H\x1b[2J" if sys.stdout.isatty() and not args.json else ""
    try:
        while True:
            try:
                text = _show(client.status(), args.json)
            except MeshdError as exc:  # keep watching: the daemon may be restarting
                text = f"{exc}\n(retrying every {interval:g} s; Ctrl-C to stop)"
            print(clear + text, flush=True)
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0


def _show(status: dict[str, Any], as_json: bool) -> str:
    return json.dumps(status, indent=2, sort_keys=True) if as_json else render_status(status)


# --------------------------------------------------------------------------- rendering


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
        head += f", up {_duration(s['uptime_s'])}"
    lines.append(head)
    lines.append(f"model: {_model(s.get('model'))}")
    lines.append("")

    members = [m for m in (s.get("members") or []) if isinstance(m, dict)]
    names = [m.get("name") or m.get("node_id") for m in members]
    links = s.get("links") if isinstance(s.get("links"), dict) else {}
    rows = [
        [
            _member_name(m, names) + (" *" if m.get("self") else ""),
            _text(m.get("state")),
            _text(m.get("address")),
            _memory(m),
            _layers(m.get("layers")),
            _text(m.get("kv_tokens")),
            _duration(m.get("uptime_s")),
            _text(m.get("version")),
            _text(m.get("model_digest")),
            _ago(m.get("last_seen_s")),
            DASH if m.get("self") else _rtt(links.get(m.get("node_id"))),
        ]
        for m in members
    ]
    if rows:
        lines += _table(["NAME", "STATE", "ADDRESS", "MEMORY", "LAYERS", "KV TOKENS", "UPTIME",
                         "VERSION", "MODEL", "LAST SEEN", "RTT"], rows)
        by_id = {m.get("node_id"): _member_name(m, names) for m in members}
        for n in s.get("not_planned") or []:
            if isinstance(n, dict) and n.get("reason"):
                who = by_id.get(n.get("node_id")) or _text(n.get("name") or n.get("node_id"))
                lines.append(f"not planned: {who}: {n['reason']}")
        errors = [(_member_name(m, names), m["last_error"]) for m in members if m.get("last_error")]
        for name, err in errors:
            lines.append(f"last error on {name}: {err}")
        for host, sharing in _same_host(members, names).items():
            lines.append(f"one machine: {', '.join(sharing)} run on {host}; each lends the memory shown from the "
                         f"same RAM (give each --memory-budget-mb so together they fit)")
        speeds = [f"{_member_name(m, names)}: {m['profile']}" for m in members if m.get("profile")]
        if speeds:
            lines.append("planned with profiles: " + "; ".join(speeds))
        how = s.get("profile")
        if isinstance(how, str) and how.startswith("shipped default:"):
            lines.append(f"this device's profile: {how}")
    else:
        lines.append("no devices in the mesh yet")
    lines.append("")

    lines.append(_plan(s.get("plan")))
    lines.append(_performance(s.get("recent"), s.get("requests_in_flight")))
    spec = _speculation(s.get("stage"))
    if spec:
        lines.append(spec)
    outline = _outline(s.get("stage"))
    if outline:
        lines.append(outline)
    cloud = _cloud(s.get("stage"))
    if cloud:
        lines.append(cloud)
    names = {m.get("node_id"): m.get("name") or m.get("node_id") for m in members if isinstance(m, dict)}
    lines += _sharing(s.get("sharing"), names)

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
        lines += _table(
            ["NAME", "ADDRESS", "REASON"],
            [[_text(n.get("name")), _text(n.get("address")), _text(n.get("reason"))] for n in seen],
            indent="  ",
        )
    return "\n".join(lines).rstrip() + "\n"


def _table(header: list[str], rows: list[list[str]], indent: str = "") -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = lambda r: indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return [fmt(header), *(fmt(r) for r in rows)]


def _member_name(m: dict[str, Any], names: list[Any]) -> str:
    """The device's name; with its node id when another member has the same name."""
    name = m.get("name") or m.get("node_id")
    if names.count(name) > 1 and m.get("node_id") and name != m.get("node_id"):
        return f"{name} ({m['node_id']})"
    return _text(name)


def _duration(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return _text(v)
    if v < 120:
        return f"{v:.0f}s"
    if v < 7200:
        return f"{v / 60:.0f}m"
    if v < 2 * 86400:
        return f"{v / 3600:.1f}h"
    return f"{v / 86400:.1f}d"


def _text(v: Any) -> str:
    return DASH if v is None or v == "" else str(v)


def _model(m: Any) -> str:
    if isinstance(m, dict):
        return _text(m.get("id") or m.get("name") or json.dumps(m, sort_keys=True))
    return _text(m) if m else "none loaded"


def _memory(m: dict[str, Any]) -> str:
    """The member's memory budget; ``memory_budget`` is in MiB, as the daemon reports it."""
    if m.get("memory_budget_bytes") is not None:
        return _bytes(m["memory_budget_bytes"])
    mb = m.get("memory_budget_mb", m.get("memory_budget"))
    if isinstance(mb, (int, float)) and not isinstance(mb, bool):
        return _bytes(mb * (1 << 20))
    return _text(mb)


def _bytes(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return _text(v)
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(v) >= size:
            return f"{v / size:.1f} {unit}"
    return f"{int(v)} B"


def _same_host(members: list[dict[str, Any]], names: list[Any]) -> dict[str, list[str]]:
    """Hosts that several members' addresses share: daemons on one machine, each of which reports
    the memory it lends as if the machine were its own."""
    by_host: dict[str, list[str]] = {}
    for m in members:
        addr = m.get("address")
        if isinstance(addr, str) and ":" in addr:
            by_host.setdefault(addr.rsplit(":", 1)[0].strip("[]"), []).append(_member_name(m, names))
    return {h: who for h, who in by_host.items() if len(who) > 1}


def _layers(v: Any) -> str:
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
            return ",".join(_layers(x) for x in v)
    return str(v)


def _ago(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return _text(v)
    if v < 1:
        return "now"
    if v < 120:
        return f"{v:.0f}s ago"
    if v < 7200:
        return f"{v / 60:.0f}m ago"
    return f"{v / 3600:.0f}h ago"


def _rtt(link: Any) -> str:
    """The control link's last round trip to a member, or "unreachable" once it stopped answering."""
    if not isinstance(link, dict):
        return DASH
    rtt = link.get("rtt_s")
    if isinstance(rtt, (int, float)) and not isinstance(rtt, bool):
        return f"{rtt * 1000:.1f} ms"
    stopped = link.get("failures") or link.get("age_s") is not None  # failed, or answered long ago
    return "unreachable" if link.get("reachable") is False and stopped else DASH


def _plan(p: Any) -> str:
    if not p:
        return "plan: none (no plan fits the devices in the mesh yet)"
    if not isinstance(p, dict):
        return f"plan: {p}"
    parts = [f"plan v{_text(p.get('version'))}"]
    stages = p.get("stages")
    if isinstance(stages, list):
        parts.append(f"{len(stages)} stage{'s' if len(stages) != 1 else ''}")
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


def _speculation(stage: Any) -> str:
    """Speculative decoding through this device's coordinator: tokens committed per verify round."""
    spec = stage.get("speculative") if isinstance(stage, dict) else None
    if not isinstance(spec, dict) or not spec.get("rounds"):
        return ""
    return (f"speculative: {spec.get('accepted_per_round', 0):.2f} tokens/verify round over "
            f"{spec['rounds']} rounds ({spec.get('accepted', 0)} of {spec.get('drafted', 0)} drafted tokens "
            f"accepted, {spec.get('requests', 0)} requests)")


def _outline(stage: Any) -> str:
    """Outline-based parallel decoding through this device's coordinator: how many requests used it,
    how many attempts fell back (their time lost) and why, and what was declined before generating."""
    o = stage.get("outline") if isinstance(stage, dict) else None
    if not isinstance(o, dict) or not (o.get("requests") or o.get("declined")):
        return ""
    used = o.get("used", 0)
    points = f", {o.get('points', 0) / used:.1f} points each" if used else ""
    line = (f"outline decoding: used by {used} of {o.get('requests', 0)} requests routed to it{points}"
            f" ({o.get('fallbacks', 0)} fell back to a plain answer{_by_reason(o.get('fallback_reasons'))})")
    declined = _by_reason(o.get("declined"))
    return line + (f"; declined before generating{declined}" if declined else "")


def _by_reason(counts: Any) -> str:
    """``": brevity 3, budget 1"`` from ``{"brevity": 3, "budget": 1}`` (empty when there are none)."""
    if not isinstance(counts, dict) or not counts:
        return ""
    return ": " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _cloud(stage: Any) -> str:
    """The paired cloud verifier: reachable or not (and since when it failed), what it checked."""
    c = stage.get("cloud") if isinstance(stage, dict) else None
    if not isinstance(c, dict):
        return ""
    link = c.get("link") if isinstance(c.get("link"), dict) else {}
    t = c.get("totals") if isinstance(c.get("totals"), dict) else {}
    state = link.get("state", DASH)
    text = f"cloud verifier {link.get('address', DASH)} ({c.get('model') or DASH}): {state}"
    if link.get("rounds"):
        text += f", RTT {link.get('rtt_ms', 0):.0f} ms"
    if state != "connected" and link.get("last_error"):
        text += f" — generating locally ({link['last_error']})"
    if t.get("chunks"):
        text += (f"; budget {c.get('budget')}: {t.get('offloaded', 0)} of {t['chunks']} chunks offloaded, "
                 f"{t.get('accepted', 0)} of {t.get('drafted', 0)} drafts accepted, "
                 f"{t.get('local_fallbacks', 0)} committed locally for want of a verdict")
    return text


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
        name = i.get("name") or DASH
        addrs = i.get("addresses") or i.get("address")
        if isinstance(addrs, list):
            addrs = " ".join(map(str, addrs))
        return f"{name} ({addrs})" if addrs else str(name)
    return str(i)


def _fetch_text(f: Any) -> str:
    """``fetching layers 10-19: 45% (10.8 / 24.0 MB, 95 Mbit/s, 1.2 s left)`` from a fetch dict."""
    if not isinstance(f, dict) or f.get("state") in (None, "idle"):
        return "idle"
    what = f"layers {_layers(f['target'])}" if f.get("target") else "the whole file" \
        if f.get("mode") == "whole" else "the header"
    text = f"{f.get('state')} {what}"
    if isinstance(f.get("progress"), (int, float)):
        text += f": {f['progress']:.0%} ({_bytes(f.get('done_bytes'))} / {_bytes(f.get('wanted_bytes'))}"
        if f.get("rate_mbit"):
            text += f", {f['rate_mbit']:g} Mbit/s"
        if f.get("eta_s"):
            text += f", {f['eta_s']:g} s left"
        text += ")"
    if f.get("error"):
        text += f" - {f['error']}"
    return text


def _sharing(sh: Any, names: dict) -> list[str]:
    """Model sharing: what this device holds and fetches, whom the plan waits for."""
    if not isinstance(sh, dict):
        return []
    holds = sh.get("holds") or {}
    if holds.get("complete"):
        held = "the whole file"
    else:
        held = f"layers {_layers(holds.get('layers'))}" + (
            f" + {', '.join(holds['tensors'])}" if holds.get("tensors") else "")
        if isinstance(holds.get("fraction"), (int, float)):
            held += f" ({holds['fraction']:.0%} of the file)"
    lines = [f"model sharing: holds {held}; {_fetch_text(sh.get('fetch'))}"]
    served = sh.get("served") or {}
    if served.get("pieces"):
        lines[-1] += f"; lent {_bytes(served.get('bytes'))} to others"
    peers = sh.get("peers") or {}
    for nid, rng in (sh.get("plan_waits_for") or {}).items():
        fetch = (peers.get(nid) or {}).get("fetch")
        lines.append(f"  plan waits for {names.get(nid, nid)} (layers {_layers(rng)}): {_fetch_text(fetch)}")
    for nid, why in (sh.get("banned") or {}).items():
        lines.append(f"  not asking {names.get(nid, nid)} for pieces: {why}")
    return lines
