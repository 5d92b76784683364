"""``meshd model pull|list``: manage the local model cache."""

from __future__ import annotations

import json

from meshd import model_store


def register(sub) -> None:
    p = sub.add_parser("model", help="manage the local model cache")
    msub = p.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    pull = msub.add_parser("pull", help="fetch and verify a model (default: the embedded default model)")
    pull.add_argument("name", nargs="?", default=None,
                      help=f"a model by name: {', '.join(sorted(model_store.CATALOG))}")
    pull.add_argument("--quiet", action="store_true")
    pull.set_defaults(func=_pull)
    ls = msub.add_parser("list", help="show cached models")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=_list)


def _pull(args) -> int:
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
    models = model_store.list_models()
    if args.json:
        print(json.dumps({"models_dir": str(model_store.models_dir()), "models": models}))
        return 0
    if not models:
        print(f"no models in {model_store.models_dir()} (run `meshd model pull`)")
        return 0
    for m in models:
        flag = " (default)" if m["default"] else ""
        print(f"{m['name']:<48} {m['size_bytes'] / 1e6:8.1f} MB  {m['path']}{flag}")
    return 0
