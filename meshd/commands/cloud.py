"""``meshd cloud``: run a cloud verifier, invite homes to it, pair a home with one.

    meshd cloud serve --model qwen2.5-coder-1.5b-instruct     # on the verifier's host
    meshd cloud invite                                        # there: prints a one-time token
    meshd cloud pair verifier.example.net TOKEN               # on any one home member
    meshd cloud unpair                                        # the home stops using it

Pairing on one member pairs the home: the record travels with the members'
heartbeats, every running daemon connects to the verifier (no restart), and a
member that joins later is vouched for by the others.

The home then lets the verifier check the share of its drafted chunks set by
``--cloud-budget`` (``meshd join``; default 0.2, 1.0 = every chunk).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

from datetime import datetime, timezone
from pathlib import Path

from meshd.cloud.held import change_pairing, paired_cloud
from meshd.errors import MeshdError


def _cloud_state_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg).expanduser()
    base = os.environ.get("STATE_DIRECTORY", "").split(":")[0]
    return Path(base) if base else Path.home() / ".local" / "state" / "meshd-cloud"


def register(subparsers) -> None:
    p = subparsers.add_parser("cloud", help="a cloud verifier for homes: serve, invite, pair",
                              description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cloud_command", metavar="SUBCOMMAND")
    s = sub.add_parser("serve", help="run a verifier (its own role and state directory)")
    s.add_argument("--model", required=True, help="the big model: a catalog name or a path")
    s.add_argument("--state-dir", default=None, help="default $STATE_DIRECTORY or ~/.local/state/meshd-cloud")
    s.add_argument("--listen", default="0.0.0.0")
    s.add_argument("--port", type=int, default=None, help="verification port (CURVE; default 5730)")
    s.add_argument("--pairing-port", type=int, default=None, help="pairing port (default 5731)")
    s.add_argument("--kv-budget", type=int, default=16384, metavar="TOKENS",
                   help="KV positions shared by all sessions (least recently used evicted beyond it)")
    s.add_argument("--max-queue", type=int, default=64, help="waiting verifications before 'busy' replies")
    s.add_argument("--no-batching", action="store_true", help="one verification per forward (for comparison)")
    s.add_argument("--preview-heads", default=None, metavar="PATH|none",
                   help="exit heads to preview verdicts with (homes pre-draft from them): a file from "
                        "'meshd heads train-exits --previews', or 'none' (default: the ones meshd ships for "
                        "the model, if any)")
    s.add_argument("--preview-layers", default=None, metavar="L,L",
                   help="preview at these of the heads' exits only (each costs every verify round a check)")
    s.set_defaults(func=serve)
    i = sub.add_parser("invite", help="print a one-time token a home uses to pair with this verifier")
    i.add_argument("--state-dir", default=None)
    i.add_argument("--ttl", type=float, default=900.0, metavar="SECONDS")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=invite)
    q = sub.add_parser("pair", help="pair this home with a verifier (run on a home member)")
    q.add_argument("address", help="the verifier's host (HOST or HOST:PAIRING_PORT)")
    q.add_argument("token", help="the token from 'meshd cloud invite'")
    q.add_argument("--state-dir", default=None, help="this member's daemon state directory")
    q.add_argument("--config", type=Path, default=None)
    q.set_defaults(func=pair)
    u = sub.add_parser("unpair", help="stop using the paired verifier")
    u.add_argument("--state-dir", default=None)
    u.add_argument("--config", type=Path, default=None)
    u.set_defaults(func=unpair)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def serve(args) -> int:
    from meshd.model import store as model_store
    from meshd.cloud.service import DEFAULT_PAIRING_PORT, DEFAULT_PORT, VerifierService
    from meshd.state import atomic_write

    source = model_store.open_model(args.model)
    state_dir = _cloud_state_dir(args.state_dir)
    previews = "shipped"
    if args.preview_heads == "none":
        previews = None
    elif args.preview_heads:
        from decoding.errors import DrafterError
        from decoding.exits.heads import ExitHeads

        cfg = source.config
        try:
            previews = ExitHeads.load(args.preview_heads, num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
                                      vocab_size=cfg.vocab_size)
        except DrafterError as exc:
            print(f"meshd cloud serve: {exc}", file=sys.stderr)
            return 2

    async def main() -> None:
        svc = VerifierService(source, state_dir, listen=args.listen,
                              port=DEFAULT_PORT if args.port is None else args.port,
                              pairing_port=DEFAULT_PAIRING_PORT if args.pairing_port is None else args.pairing_port,
                              kv_budget_tokens=args.kv_budget, max_queue=args.max_queue,
                              batched=not args.no_batching, previews=previews,
                              preview_layers=[int(x) for x in args.preview_layers.split(",")]
                              if args.preview_layers else None)
        print(f"loading {svc.model_id} ...", flush=True)
        await svc.start()
        atomic_write(svc.state.root / "verifier.json", json.dumps(
            {"port": svc.port, "pairing_port": svc.pairing_port, "model": svc.model_id, "pid": os.getpid()}
        ).encode())
        print(f"verifier ready: {svc.address} (pairing on port {svc.pairing_port}); "
              f"invite a home with: meshd cloud invite --state-dir {svc.state.root}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            while not stop.is_set():
                try:
                    await asyncio.wait_for(stop.wait(), 60.0)
                except TimeoutError:
                    from meshd.log import get_logger
                    get_logger("meshd.cloud").info("verifier_status", **svc.status())
        finally:
            await svc.close()
            (svc.state.root / "verifier.json").unlink(missing_ok=True)

    asyncio.run(main())
    return 0


def invite(args) -> int:
    from meshd.cloud.pairing import create_cloud_invite
    from meshd.cloud.service import DEFAULT_PAIRING_PORT
    from meshd.mesh.discovery import select_interfaces
    from meshd.state import StateDir

    state = StateDir(_cloud_state_dir(args.state_dir)).ensure()
    try:
        port = int(json.loads((state.root / "verifier.json").read_text())["pairing_port"])
    except (OSError, ValueError, KeyError):
        port = DEFAULT_PAIRING_PORT
    addresses = [a for i in select_interfaces(None) for a in i.addresses]
    token, expires = create_cloud_invite(state, addresses, port, args.ttl)
    if args.json:
        print(json.dumps({"token": token.encode(), "expires_at": expires, "pairing_port": port}))
    else:
        when = datetime.fromtimestamp(expires, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        print(token.encode())
        print(f"\nOne home can use this token until {when}; on any of its members run:\n"
              f"  meshd cloud pair <this host> {token.encode()}", flush=True)
    return 0


def _home_state(args):
    from meshd.config import load_config
    from meshd.state import StateDir

    cfg = load_config(args.config, os.environ, {"state_dir": args.state_dir})
    return cfg, StateDir(cfg.resolved_state_dir())


def pair(args) -> int:
    from decoding.speculative.draft_model import tokenizer_fingerprint
    from meshd.model import store as model_store
    from meshd.cloud.pairing import pair_with_cloud
    from meshd.mesh.pairing import Token

    cfg, state = _home_state(args)
    home = state.home()
    if home is None:
        raise MeshdError("this device is not in a home yet: run 'meshd join --new-home NAME' first")
    host, _, port = args.address.rpartition(":") if args.address.count(":") == 1 else (args.address, "", "")
    token = Token.decode(args.token)
    keys = sorted({m.public_key for m in state.members().values()} | {state.keypair().public.decode()})
    tokenizer = tokenizer_fingerprint(model_store.open_model(cfg.model).tokenizer)
    info = asyncio.run(pair_with_cloud(host or args.address, token, home.home_id, home.name, keys, tokenizer,
                                       int(port) if port else None))
    change_pairing(state, info)
    print(f"paired with the verifier at {info['address']} (model {info['model']}); "
          "the home's running daemons use it within a few heartbeats", flush=True)
    return 0


def unpair(args) -> int:
    _, state = _home_state(args)
    had = paired_cloud(state)
    if had:  # a tombstone unpairs the whole home: write one only when there is something to undo
        change_pairing(state, None)
    print("unpaired: the home's running daemons stop using it within a few heartbeats" if had
          else "no verifier was paired", flush=True)
    return 0


