"""``meshd model advise``: gather what the home is (members, memory, measured speed), then ``meshd.model.advice``.

Where each fact comes from, in order of preference, and said in the output:

- members and their memory budgets: the local daemon's status when one answers (the
  members it counts as present); otherwise this device alone, with the daemon's default
  budget (half of physical memory); ``--memory`` overrides the total;
- speed: this device's newest profile in the state directory (``meshd profile --install``
  or the daemon's own one-layer measurement); otherwise the shipped profile of the model
  recommended for Home Assistant (a reference machine, not this one). Every member is
  assumed as fast as that measurement: members share no profile numbers in their status.
"""

from __future__ import annotations

import json
from pathlib import Path

from meshd.model import catalog as model_catalog, store as model_store
from meshd.errors import MeshdError
from meshd.model.hub_models import HA_EVAL
from meshd.model.advice import Candidate, Member, Speed, advise, speed_from_profile

USABLE_TOKENS_PER_S = 2.0  # below this a spoken answer of a sentence takes longer than people wait


def run(args) -> int:
    from meshd.share import cli as share

    state = share.state_dir(args.state_dir)
    speed = _speed(state)
    members, where = _members(args, speed)
    if args.memory:
        from partition.scaling import parse_size

        total = parse_size(args.memory)
        members, where = [Member("--memory", total, speed)], f"--memory {args.memory}"
    rows = model_catalog.rows()
    cands = [Candidate(r.name, r.source, r.size_bytes, r.success, r.pulled) for r in rows]
    advice = advise(members, cands)
    pooled = sum(m.budget_bytes for m in members)
    if args.json:
        print(json.dumps({
            "members": [{"name": m.name, "memory_budget_bytes": m.budget_bytes} for m in members],
            "members_from": where, "pooled_bytes": pooled,
            "speed": {"step_s": speed.step_s, "file_bytes": speed.file_bytes, "runtime_bytes": speed.runtime_bytes,
                      "source": speed.source},
            "estimate": "decode tokens/s scaled from the measured speed by weight bytes (memory bandwidth); "
                        "network hops left out",
            "models": [{"name": a.candidate.name, "source": a.candidate.source, "file_bytes": a.candidate.file_bytes,
                        "needs_bytes": a.needs_bytes, "fits": a.fits, "devices": a.devices,
                        "tokens_per_s_estimate": None if a.tokens_per_s is None else round(a.tokens_per_s, 2),
                        "command_success": None if a.candidate.success is None else a.candidate.success.percent,
                        "pulled": a.candidate.pulled} for a in advice]}))
        return 0
    print(f"home: {len(members)} device(s), {pooled / 1e9:.1f} GB of memory lent to the model ({where})")
    print(f"speed: {1 / speed.step_s:.1f} tokens/s measured on a {speed.file_bytes / 1e9:.2f} GB model "
          f"({speed.source})")
    print(f"  {'MODEL':<29} {'NEEDS':>8}  {'FITS':<4} {'TOKENS/S*':>9}  {'HA COMMANDS':<11}  SOURCE")
    for a in advice:
        c = a.candidate
        rate = f"{a.tokens_per_s:.1f}" if a.tokens_per_s is not None else "-"
        fits = f"yes{'' if a.devices <= 1 else f' ({a.devices})'}" if a.fits else "no"
        fig = f"{c.success.percent:.1f} %" if c.success else "-"
        print(f"  {c.name:<29} {a.needs_bytes / 1e9:6.1f} GB  {fits:<4} {rate:>9}  {fig:<11}  {c.source}")
    usable = [a for a in advice if a.fits and a.candidate.success]
    best = next((a for a in usable if (a.tokens_per_s or 0) >= USABLE_TOKENS_PER_S), None)
    if best is not None:
        print(f"suggested: meshd model pull {best.candidate.name}, then meshd join --model {best.candidate.name} "
              f"(the best command success at {USABLE_TOKENS_PER_S:g}+ tokens/s estimated)")
    elif usable:
        print(f"no model with a published figure reaches {USABLE_TOKENS_PER_S:g} tokens/s here; more devices "
              f"or faster ones would help")
    print(f"* an estimate: decode speed scales with the weight bytes each token reads, from the measurement "
          f"above; network hops are left out. HA COMMANDS: {HA_EVAL} (home-assistant-datasets), or our bench.")
    return 0


def _members(args, speed: Speed) -> tuple[list[Member], str]:
    status = _daemon_status(args)
    if status is not None:
        members = [Member(m.get("name") or m.get("node_id") or "?", int(m["memory_budget"]) << 20, speed)
                   for m in status.get("members") or []
                   if m.get("state") not in ("offline", "gone") and m.get("memory_budget")]
        if members:
            return members, "the running daemon's members"
    from meshd.config import Config

    return [Member("this device", Config().memory_budget_mb << 20, speed)], \
        "this device alone: no daemon answered; its default budget, half of physical memory"


def _daemon_status(args) -> dict | None:
    from meshd.client import MeshdClient
    from meshd.commands.status import daemon_socket

    try:
        sock = daemon_socket(args.socket, args.state_dir)
        with MeshdClient(sock, timeout=3.0) as client:
            return client.status()
    except (MeshdError, OSError):
        if args.socket:
            raise
        return None


def _speed(state: Path) -> Speed:
    from meshd.model.profile_files import profile_model, read_profiles

    for _, data in read_profiles(state / "profiles", newest_first=True):
        sp = speed_from_profile(data, _file_bytes(profile_model(data)),
                                f"this device's profile, {'one-layer estimate' if data.get('scaled_from') else 'measured'}"
                                f" {str(data.get('measured_at', ''))[:10]}")
        if sp is not None:
            return sp
    from meshd.mesh.home_plan import shipped_profiles_dir

    shipped = shipped_profiles_dir()
    rec = model_store.CATALOG[model_store.RECOMMENDED_FOR_HOME_ASSISTANT]
    for path, data in read_profiles(shipped):
        if data.get("dtype") == "packed" and (profile_model(data) or "").startswith(rec.file_name):
            sp = speed_from_profile(data, rec.size, f"the shipped profile {path.name}: a reference machine, "
                                                    f"not this one (run `meshd profile --install`)")
            if sp is not None:
                return sp
    raise MeshdError("no device profile to estimate speeds from (run `meshd profile --install`)")


def _file_bytes(identity: str | None) -> int | None:
    """The size of the model file a profile was measured on, when this device knows it."""
    name = (identity or "").partition("@")[0]
    if not name:
        return None
    if name == model_store.DEFAULT_MODEL.name:
        return model_store.DEFAULT_MODEL.size
    for m in model_store.CATALOG.values():
        if m.file_name == name:
            return m.size
    hits = [p for p in model_store.models_dir().rglob(name) if p.is_file()]
    return hits[0].stat().st_size if hits else None
