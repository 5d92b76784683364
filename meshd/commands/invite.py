"""``meshd invite``: print a one-time token that lets one new device join this home.

Works on the state directory directly (no running daemon needed to *create* the
token): the token's secret is stored hashed with its expiry in
``invites.json``, and the daemon's pairing endpoint reads that file when the
new device connects. The token embeds where to connect: the running daemon's
pairing port and addresses (from its ``daemon.json``), or the configured port
and this host's addresses when the daemon is not running yet. Run it as the
user that owns the state directory, with its path (for the systemd service:
``sudo -u meshd env MESHD_HOME=/var/lib/meshd meshd invite``). A path that
holds no home is an error before anything is written: no node id is created
there, and no second home is suggested.
"""

from __future__ import annotations

import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path

from meshd.config import load_config
from meshd.mesh.discovery import select_interfaces
from meshd.mesh.pairing import create_invite
from meshd.paths import STATE_DIR_HELP
from meshd.state import RUNTIME_FILE, StateDir


def register(subparsers) -> None:
    p = subparsers.add_parser("invite", help="print a one-time token for a new device to join this home",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=None, help="TOML config file")
    p.add_argument("--state-dir", default=None, help=STATE_DIR_HELP)
    p.add_argument("--ttl", type=float, default=None, metavar="SECONDS",
                   help="how long the token stays valid (default 900)")
    p.add_argument("--json", action="store_true", help="print {token, expires_at} as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    cfg = load_config(args.config, os.environ, {"state_dir": args.state_dir, "invite_ttl_s": args.ttl})
    state = StateDir.of_home(cfg.resolved_state_dir())
    try:
        info = json.loads((state.root / RUNTIME_FILE).read_text())
        port, addresses = int(info["pairing_port"]), list(info["addresses"])
    except (OSError, ValueError, KeyError):
        port = cfg.pairing_port
        addresses = [a for i in select_interfaces(cfg.interface) for a in i.addresses]
    token, expires = create_invite(state, state.node_id(), addresses, port, cfg.invite_ttl_s)
    text = token.encode()
    if args.json:
        print(json.dumps({"token": text, "expires_at": expires, "pairing_port": port,
                          "addresses": addresses}))
    else:
        when = datetime.fromtimestamp(expires, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        mins = max(0, round((expires - time.time()) / 60))
        print(text)
        print(f"\nOne device can use this token until {when} (about {mins} min):\n"
              f"  meshd join --token {text}", flush=True)
    return 0
