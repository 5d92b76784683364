"""The status lines for what this device does beyond serving its layers.

Speculative and outline decoding through its coordinator, a paired cloud
verifier, model sharing. Each function is empty (or returns no lines) when
the status has nothing to say about its room.
"""

from __future__ import annotations

from typing import Any

from meshd.commands import status_cells as cell


def speculation_line(stage: Any) -> str:
    """Speculative decoding through this device's coordinator: tokens committed per verify round."""
    spec = stage.get("speculative") if isinstance(stage, dict) else None
    if not isinstance(spec, dict) or not spec.get("rounds"):
        return ""
    line = (f"speculative: {spec.get('accepted_per_round', 0):.2f} tokens/verify round over "
            f"{spec['rounds']} rounds ({spec.get('accepted', 0)} of {spec.get('drafted', 0)} drafted tokens "
            f"accepted, {spec.get('requests', 0)} requests); {spec.get('steps_per_token', 0):.2f} model steps "
            f"per token")
    g = spec.get("under_grammar")
    if isinstance(g, dict) and g.get("requests"):
        line += (f"; under a grammar: {g.get('accepted', 0)} of {g.get('drafted', 0)} drafted accepted "
                 f"({g.get('forced_accepted', 0)} of {g.get('forced_drafted', 0)} forced), "
                 f"{g.get('steps_per_token', 0):.2f} steps per token over {g['requests']} requests")
    return line


def outline_line(stage: Any) -> str:
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


def prefix_line(stage: Any) -> str:
    """The prefix cache: how often requests started on a held prefix, and what this stage keeps."""
    p = stage.get("prefix_cache") if isinstance(stage, dict) else None
    if not isinstance(p, dict):
        return ""
    if not p.get("enabled", True):
        return "prefix cache: off"
    req = p.get("requests") if isinstance(p.get("requests"), dict) else {}
    asked = req.get("requests", 0)
    rate = f"{100 * req.get('hit_rate', 0):.0f}% of {asked} requests" if asked else "no requests yet"
    pinned = f", {p.get('pinned')} pinned" if p.get("pinned") else ""
    return (f"prefix cache: {rate} reused a prefix ({req.get('reused_tokens', 0)} prompt tokens not recomputed); "
            f"this stage keeps {p.get('entries', 0)} prefixes, {p.get('held_tokens', 0)} tokens"
            f"{pinned}, {p.get('evictions', 0)} evicted")


def exits_line(stage: Any) -> str:
    """Early exits on this stage: where tokens left the model, of the decode steps that asked."""
    if not isinstance(stage, dict):
        return ""
    layers, e, note = stage.get("exit_layers"), stage.get("exits"), stage.get("exits_note")
    if not layers:
        return f"early exits: {note}" if note and not str(note).startswith("off") else ""
    asked = e.get("asked", 0) if isinstance(e, dict) else 0
    where = ", ".join(f"after layer {k}: {v}" for k, v in (e.get("by_layer") or {}).items()) \
        if isinstance(e, dict) else ""
    if not asked:
        return f"early exits: ready after layers {', '.join(map(str, layers))}; no request asked for them yet"
    return (f"early exits: {100 * e.get('rate', 0):.0f}% of {asked} decode steps left early"
            + (f" ({where})" if where else ""))


def _by_reason(counts: Any) -> str:
    """``": brevity 3, budget 1"`` from ``{"brevity": 3, "budget": 1}`` (empty when there are none)."""
    if not isinstance(counts, dict) or not counts:
        return ""
    return ": " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def cloud_line(stage: Any) -> str:
    """The paired cloud verifier: reachable or not (and since when it failed), what it checked."""
    c = stage.get("cloud") if isinstance(stage, dict) else None
    if not isinstance(c, dict):
        return ""
    link = c.get("link") if isinstance(c.get("link"), dict) else {}
    t = c.get("totals") if isinstance(c.get("totals"), dict) else {}
    state = link.get("state", cell.DASH)
    text = f"cloud verifier {link.get('address', cell.DASH)} ({c.get('model') or cell.DASH}): {state}"
    if link.get("rounds"):
        text += f", RTT {link.get('rtt_ms', 0):.0f} ms"
    if state != "connected" and link.get("last_error"):
        text += f" — generating locally ({link['last_error']})"
    if t.get("chunks"):
        text += (f"; budget {c.get('budget')}: {t.get('offloaded', 0)} of {t['chunks']} chunks offloaded, "
                 f"{t.get('accepted', 0)} of {t.get('drafted', 0)} drafts accepted, "
                 f"{t.get('local_fallbacks', 0)} committed locally for want of a verdict")
    if t.get("previews") or c.get("previews"):
        text += (f"; previews: {t.get('previews', 0)} received, {t.get('predraft_hits', 0)} of "
                 f"{t.get('predraft_rounds', 0)} pre-drafted rounds hit, "
                 f"{t.get('predraft_saved_s', 0.0):.1f} s of drafting saved")
    return text



def _fetch_text(f: Any) -> str:
    """``fetching layers 10-19: 45% (10.8 / 24.0 MB, 95 Mbit/s, 1.2 s left)`` from a fetch dict."""
    if not isinstance(f, dict) or f.get("state") in (None, "idle"):
        return "idle"
    what = f"layers {cell.layers(f['target'])}" if f.get("target") else "the whole file" \
        if f.get("mode") == "whole" else "the header"
    text = f"{f.get('state')} {what}"
    if isinstance(f.get("progress"), (int, float)):
        done, wanted = cell.data_size(f.get("done_bytes")), cell.data_size(f.get("wanted_bytes"))
        text += f": {f['progress']:.0%} ({done} / {wanted}"
        if f.get("rate_mbit"):
            text += f", {f['rate_mbit']:g} Mbit/s"
        if f.get("eta_s"):
            text += f", {f['eta_s']:g} s left"
        text += ")"
    if f.get("error"):
        text += f" - {f['error']}"
    return text


def sharing_lines(sh: Any, names: dict) -> list[str]:
    """Model sharing: what this device holds and fetches, whom the plan waits for."""
    if not isinstance(sh, dict):
        return []
    holds = sh.get("holds") or {}
    if holds.get("complete"):
        held = "the whole file"
    else:
        held = f"layers {cell.layers(holds.get('layers'))}" + (
            f" + {', '.join(holds['tensors'])}" if holds.get("tensors") else "")
        if isinstance(holds.get("fraction"), (int, float)):
            held += f" ({holds['fraction']:.0%} of the file)"
    lines = [f"model sharing: holds {held}; {_fetch_text(sh.get('fetch'))}"]
    served = sh.get("served") or {}
    if served.get("pieces"):
        lines[-1] += f"; lent {cell.data_size(served.get('bytes'))} to others"
    peers = sh.get("peers") or {}
    for nid, rng in (sh.get("plan_waits_for") or {}).items():
        fetch = (peers.get(nid) or {}).get("fetch")
        lines.append(f"  plan waits for {names.get(nid, nid)} (layers {cell.layers(rng)}): {_fetch_text(fetch)}")
    for nid, why in (sh.get("banned") or {}).items():
        lines.append(f"  not asking {names.get(nid, nid)} for pieces: {why}")
    return lines
