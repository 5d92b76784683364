"""``meshd plan``: split the model over devices from their profiles, and chunk a prompt.

Offline and pure: reads profile files (or scales a measured one for a device
not measured yet, ``PATH@speed=0.5,mem=4GiB,id=tablet``; a profile shipped with
meshd is also found by its name, e.g. ``x86_64-2core-1thread``), prints the layer
ranges per device (``first-last``, both run; the JSON says half-open
``first_layer``/``end_layer``), the predicted bottleneck and why, and for ``--prompt-len``
the chunk cut points and predicted prefill latency. ``--json`` adds one JSON
object as the last stdout line; ``--out`` writes the full plan (with the cut
table) in the form the daemon broadcasts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from partition.plan import DEFAULT_LINK


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plan",
        help="plan layer ranges and prompt chunking from device profiles",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--profile", action="append", required=True, metavar="PATH[@speed=F,mem=SIZE,id=NAME]",
                   help="a device profile (repeat per device), or the name of one shipped with meshd "
                        "(e.g. x86_64-2core-1thread); @... scales it for an unmeasured device")
    p.add_argument("--link", default=DEFAULT_LINK, metavar="BANDWIDTH[,RTT]",
                   help=f"link between devices, e.g. 100mbit,2ms or 1gbit,0.5ms or local (default {DEFAULT_LINK})")
    p.add_argument("--max-seq", type=int, default=2048,
                   help="longest sequence: KV cache sized for it, cut table up to it (default 2048)")
    p.add_argument("--plan-seq-len", type=int, default=None,
                   help="prompt length the layer split is balanced for (default: --max-seq)")
    p.add_argument("--prompt-len", type=int, default=None,
                   help="also print the chunk cut points and predicted prefill latency for this prompt")
    p.add_argument("--exact-limit", type=int, default=None,
                   help="search device subsets and orders exactly up to this many devices (default 10)")
    p.add_argument("--layout", choices=("auto", "pipeline", "replicas", "tensor"), default="auto",
                   help="layout to price for the workload below (default auto: the cheapest of replicas, one "
                        "pipeline, a tensor-parallel group, or a mix; the stage table above is always the one "
                        "pipeline's)")
    p.add_argument("--in-flight", type=float, default=1.0, help="requests in flight at once (default 1)")
    p.add_argument("--answer-tokens", type=int, default=64, help="answer tokens per request (default 64)")
    p.add_argument("--cached", type=float, default=0.0,
                   help="share of each prompt the prefix cache holds, 0..0.99 (default 0)")
    p.add_argument("--out", default=None, help="write the full plan JSON (with cut table) here")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.set_defaults(func=run)


def _fmt_bytes(n: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.1f} {unit}"
    return f"{int(n)} B"


def _unique_ids(profiles):
    """The same profile given twice means two identical devices: name them apart."""
    import dataclasses

    seen: dict[str, int] = {}
    out = []
    for p in profiles:
        n = seen.get(p.device_id, 0) + 1
        seen[p.device_id] = n
        out.append(p if n == 1 else dataclasses.replace(p, device_id=f"{p.device_id}#{n}"))
    return out


def resolve_profile_arg(arg: str) -> str:
    """``arg`` with its path made one that exists: as given, else the profile of that name shipped
    with meshd (so ``profiles/x.json`` from the README works in an installed meshd too).

    A name that is neither is a one-line error saying what is shipped, or that nothing is (an
    incomplete installation), rather than a planner that quietly has less to go on.
    """
    from meshd.errors import MeshdError
    from meshd.mesh.home_plan import shipped_profiles_dir

    path, at, opts = arg.partition("@")
    if Path(path).exists():
        return arg
    shipped = shipped_profiles_dir()
    name = Path(path).name
    found = shipped / (name if name.endswith(".json") else f"{name}.json")
    if found.is_file():
        print(f"profile {path}: the one shipped with meshd ({found})", file=sys.stderr)
        return f"{found}{at}{opts}"
    names = sorted(p.stem for p in shipped.glob("*.json"))
    known = f"shipped with meshd: {', '.join(names)}" if names else \
        f"no profile is shipped in {shipped}: the installation is incomplete, reinstall meshd"
    raise MeshdError(f"--profile {path}: no such file, nor a profile of that name ({known})")


def run(args) -> int:
    from meshd.errors import MeshdError
    from partition.link import parse_link
    from partition.layout import Workload, choose_layout
    from partition.planner import layout_account, make_plan, predict_decode_step_s, predict_prefill_s
    from partition.scaling import parse_profile_arg

    if args.max_seq < 1:
        raise MeshdError("--max-seq must be at least 1")
    if args.prompt_len is not None and not 1 <= args.prompt_len <= args.max_seq:
        raise MeshdError(f"--prompt-len must be between 1 and --max-seq ({args.max_seq})")
    if args.plan_seq_len is not None and not 1 <= args.plan_seq_len <= args.max_seq:
        raise MeshdError(f"--plan-seq-len must be between 1 and --max-seq ({args.max_seq})")
    link = parse_link(args.link)
    profiles = _unique_ids([parse_profile_arg(resolve_profile_arg(a)) for a in args.profile])
    plan = make_plan(profiles, link, args.max_seq, plan_seq_len=args.plan_seq_len,
                     exact_limit=args.exact_limit)

    out = sys.stdout
    m = profiles[0].model
    print(f"model {m.identity}: {m.num_layers} layers; {len(profiles)} device profile(s); "
          f"link {link.describe()}; max_seq {plan.max_seq}; split balanced for "
          f"{plan.plan_seq_len}-token prompts", file=out)
    print(f"{'stage':<6}{'device':<24}{'layers':<18}{'compute':>10}{'send':>10}   memory / budget",
          file=out)
    for k, s in enumerate(plan.stages, 1):
        extra = ("+emb" if s.has_embedding else "") + ("+head" if s.has_head_of(plan.num_layers) else "")
        layers = f"{s.first}-{s.end - 1} {extra}".strip()  # for people: the first and last layer it runs
        print(f"{k:<6}{s.node_id:<24}{layers:<18}{s.compute_s:>9.3f}s{s.transfer_s:>9.3f}s"
              f"   {_fmt_bytes(s.memory_bytes)} / {_fmt_bytes(s.memory_budget_bytes)}", file=out)
    if plan.unused_devices:
        print(f"unused devices: {', '.join(plan.unused_devices)} (with them prompts would not be faster)",
              file=out)
    bn = plan.stages[plan.bottleneck_stage]
    print(f"bottleneck: stage {plan.bottleneck_stage + 1} ({bn.node_id}) {plan.predicted_bottleneck_s:.3f} s "
          f"per {plan.plan_seq_len}-token prompt, {plan.bottleneck_reason}-bound: {plan.explanation}",
          file=out)
    search = "exact over device subsets and orders" if plan.exact_search else \
        "heuristic (fastest-first order, exact subset)"
    print(f"planned in {plan.planning_seconds:.2f} s ({search})", file=out)

    summary = {
        "planning_seconds": plan.planning_seconds,
        "stages": [s.to_dict(plan.num_layers) for s in plan.stages],  # [first_layer, end_layer)
        "bottleneck": plan.to_dict()["bottleneck"],
        "unused_devices": list(plan.unused_devices),
        "link": link.to_dict(),
        "max_seq": plan.max_seq,
        "plan_seq_len": plan.plan_seq_len,
        "exact_search": plan.exact_search,
        "predicted_decode_step_s": predict_decode_step_s(plan, profiles, plan.max_seq // 2),
    }
    if args.prompt_len is not None:
        y = args.prompt_len
        cuts = plan.cut_table.lookup(y)
        ttft = plan.cut_table.predicted_latency_s(y)
        single = predict_prefill_s(plan, profiles, y, cuts=())
        chunks = [b - a for a, b in plan.cut_table.chunks(y)]
        print(f"prompt {y} tokens: {len(chunks)} chunk(s) of {chunks}; cuts {list(cuts)}; "
              f"predicted prefill {ttft:.3f} s (unchunked {single:.3f} s)", file=out)
        summary.update({"prompt_len": y, "cuts": list(cuts), "chunks": chunks,
                        "predicted_ttft_s": ttft, "unchunked_prefill_s": single})
    try:
        work = Workload(args.prompt_len or plan.plan_seq_len, args.answer_tokens, args.cached, args.in_flight)
    except ValueError as exc:
        raise MeshdError(str(exc)) from None
    # (what-if pricing: tensor groups among the candidates, whether or not a home's daemons serve them yet)
    chosen = choose_layout(profiles, link, work, args.max_seq, force=args.layout, tensor=True)
    routes = "; ".join(" -> ".join(f"{'+'.join(g.tensor) if g.tensor else n} [{a},{b})" for n, a, b in g.stages)
                       for g in chosen.groups)
    print(f"layout {chosen.kind}: {routes}", file=out)
    print(f"  {chosen.reason}", file=out)
    summary["layout"] = {**layout_account(chosen), "reason": chosen.reason,
                         "routes": [[[n, a, b] for n, a, b in g.stages] for g in chosen.groups],
                         "tensor_groups": [list(g.tensor) for g in chosen.groups if g.tensor]}
    if args.out:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(plan.to_dict(), separators=(",", ":")) + "\n")
        print(f"plan written to {path}", file=out)
    if args.json:
        print(json.dumps(summary, separators=(",", ":")), file=out)
    return 0
