"""``meshd apikey create|list|revoke``: keys for the API's LAN listener (``meshd join --http``).

Keys live hashed in the state directory (``api_keys.json``), so run these as
the daemon's user with the same ``--state-dir`` or ``$MESHD_HOME`` (for the
systemd service: ``sudo -u meshd env MESHD_HOME=/var/lib/meshd meshd apikey
create ha``). The directory must already hold a home: a mistyped path is an
error, never a fresh directory whose keys no daemon reads.
The running daemon picks changes up on the next request; no restart.
A key is printed once, at creation: store it in the client (Home Assistant's
"API key" field, ``OPENAI_API_KEY``...).
"""

from __future__ import annotations

import datetime
import json
import os

from meshd.apikeys import ApiKeyStore
from meshd.config import load_config
from meshd.paths import STATE_DIR_HELP
from meshd.state import StateDir


def register(subparsers) -> None:
    p = subparsers.add_parser("apikey", help="create, list or revoke API keys for the LAN listener",
                              description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="apikey_command", metavar="ACTION", required=True)
    for name, help_text in (("create", "create a key and print it (once)"), ("list", "list keys"),
                            ("revoke", "revoke a key by name")):
        q = sub.add_parser(name, help=help_text)
        q.add_argument("--state-dir", default=None, help=STATE_DIR_HELP)
        q.add_argument("--config", default=None, help="TOML config file")
        if name in ("create", "revoke"):
            q.add_argument("name", nargs="?" if name == "create" else None,
                           default="default" if name == "create" else None,
                           help="a label for the key, e.g. home-assistant")
        q.add_argument("--json", action="store_true", help="machine-readable output (last line)")
        q.set_defaults(func={"create": _create, "list": _list, "revoke": _revoke}[name])


def _store(args) -> ApiKeyStore:
    cfg = load_config(args.config, os.environ, {"state_dir": args.state_dir})
    return ApiKeyStore(StateDir.of_home(cfg.resolved_state_dir()).root)


def _create(args) -> int:
    store = _store(args)
    key = store.create(args.name)
    if args.json:
        print(json.dumps({"name": args.name, "key": key}))
    else:
        print(f"API key {args.name!r} (shown once; stored hashed in {store.path}):\n{key}")
    return 0


def _list(args) -> int:
    keys = store_keys = _store(args).keys()
    if args.json:
        print(json.dumps({"keys": [{"name": k.name, "id": k.key_id, "created": k.created}
                                   for k in store_keys]}))
        return 0
    if not keys:
        print("no API keys (create one with 'meshd apikey create NAME')")
    for k in keys:
        when = datetime.datetime.fromtimestamp(k.created).strftime("%Y-%m-%d %H:%M")
        print(f"{k.name:<24} id {k.key_id}  created {when}")
    return 0


def _revoke(args) -> int:
    gone = _store(args).revoke(args.name)
    if args.json:
        print(json.dumps({"revoked": gone.name, "id": gone.key_id}))
    else:
        print(f"revoked {gone.name!r} (id {gone.key_id}); requests with it now get 401")
    return 0
