"""``meshd join``: run the daemon in the foreground (this is what systemd runs).

First run on the first device: ``meshd join --new-home NAME`` creates the home.
First run on every other device: ``meshd join --token T`` with a token from
``meshd invite`` on a member. Afterwards plain ``meshd join`` (the systemd
unit) rejoins the home recorded in the state directory. ``--setup-only`` does
the first-run step and exits instead of serving: the systemd install's one-off
step as the service's user, which then ends by itself (no Ctrl-C at the right
moment, no wait for a model) and leaves serving to the service.

Settings: defaults < ``/etc/meshd/meshd.toml`` (or ``--config``) <
``MESHD_*`` environment variables < the flags below.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import structlog

from meshd import log
from meshd.config import load_config, placement_of
from meshd.errors import MeshdError
from meshd.paths import STATE_DIR_HELP, legacy_state_dir_note
from meshd.state import StateDir

# flag -> Config field; every one defaults to None ("not given").
_FLAGS = [
    ("--state-dir", "state_dir", str, STATE_DIR_HELP),
    ("--socket", "socket", str, "client API unix socket"),
    ("--name", "name", str, "this device's name (default: host name)"),
    ("--listen", "listen", str, "address the transport and pairing ports bind (default 0.0.0.0)"),
    ("--port", "port", int, "transport port (default 7410; 0 = any free port)"),
    ("--pairing-port", "pairing_port", int, "pairing port for invites (default 7411; 0 = any)"),
    ("--interface", "interface", str, "advertise over mDNS only on this interface (name or IPv4)"),
    ("--memory-budget-mb", "memory_budget_mb", int, "memory this device lends to the model"),
    ("--model", "model", str, "model path; 'none' runs the control plane only"),
    ("--device", "device", str, "where this device's stage computes: auto (default: CUDA when available), "
                                "cpu, cuda or cuda:N"),
    ("--weights", "weights", str, "numeric mode: auto (default: on a CPU the faster of gguf and packed, "
                                  "bfloat16 or float16 on a GPU), float32, bfloat16, float16, "
                                  "gguf (the file's blocks, mapped, times int8 activations: llama.cpp's arithmetic), "
                                  "packed (the file's 4-bit codes kept, wider ones as 8-bit, bfloat16 activations), "
                                  "packed4 (every matrix 4-bit: faster, less faithful); "
                                  "the leader's mode is the plan's"),
    ("--dtype", "dtype", str, "older spelling of a dense --weights mode: float32, bfloat16, float16"),
    ("--wire-dtype", "wire_dtype", str, "dtype of the activations this device sends to the next stage: "
                                        "float32 (default), float16 or bfloat16 (half the bytes per hop)"),
    ("--self-profile", "self_profile", str, "quick (default): with no profile of this model yet, time one "
                                            "layer at start-up so plans weigh this device by its speed; off"),
    ("--heartbeat-interval", "heartbeat_interval_s", float, "seconds between heartbeats"),
    ("--suspect-after", "suspect_after_s", float, "silence before a member is suspect"),
    ("--gone-after", "gone_after_s", float, "silence before a member is gone"),
    ("--api-listen", "api_listen", str, "also serve the API on loopback TCP (HOST:PORT), no key unless "
                                        "--require-keys"),
    ("--http", "http", str, "serve the API (OpenAI + Ollama) on TCP, e.g. 0.0.0.0:11434; "
                            "off loopback every request needs a key from 'meshd apikey create'"),
    ("--tls-cert", "tls_cert", str, "PEM certificate chain: --http speaks HTTPS"),
    ("--tls-key", "tls_key", str, "PEM private key for --tls-cert"),
    ("--model-aliases", "model_aliases", str, "other model names requests may use, comma-separated "
                                              "(e.g. llama3.2:3b,gpt-4o-mini; '*' accepts any); other "
                                              "names get a 404 'model not found'"),
    ("--share-rate", "share_rate", str, "cap on lending/fetching model pieces (50mbit, 12.5MB/s; default none)"),
    ("--prefix-cache-share", "prefix_cache_share", float, "share of each stage's KV budget that finished "
                                                          "requests may keep for later prompts starting the "
                                                          "same way (default 0.5; 0 turns the prefix cache off)"),
    ("--pin-prompt", "pin_prompts", str, "prompts whose prefix is never evicted once computed, comma-separated "
                                         "files: the text, or a JSON chat request {\"messages\": [...], "
                                         "\"tools\": [...]} (e.g. Home Assistant's system prompt)"),
    ("--layout", "layout", str, "how the home lays the model out (the leader's setting decides): auto "
                                "(default: priced per workload), pipeline (one pipeline over the members), "
                                "replicas (every member holding the whole model runs it alone), tensor "
                                "(members split every layer between them, gguf mode)"),
    ("--link", "link", str, "the link between members the leader prices layouts over, BANDWIDTH[,RTT] "
                            "(default 100mbit,2ms: a Wi-Fi hop; e.g. 1gbit,0.3ms on a wired LAN, where a "
                            "tensor group may pay; 'meshd status' shows measured round trips)"),
    ("--exit-threshold", "exit_threshold", float, "early exits (Synera, lossy) for requests that do not say: "
                                                  "a token leaves the model where its top-2 margin clears "
                                                  "this, 0..1 (default 0: off; 0.7 is the paper's)"),
    ("--exit-heads", "exit_heads", str, "early-exit heads file (default: the ones shipped with the embedded "
                                        "model; 'none': off)"),
    ("--cloud-budget", "cloud_budget", float, "share of drafted chunks a paired cloud verifier checks, "
                                              "0..1 (default 0.2; 1 = every chunk: the big model's output)"),
    ("--cloud-min-timeout", "cloud_min_timeout_s", float, "shortest wait in seconds for a cloud verdict "
                                                         "before a chunk is committed locally (default 1)"),
    ("--cloud-previews", "cloud_previews", int, "pre-drafts a round may start from a paired verifier's early "
                                                 "verdicts, when it offers them (default 0: off; lossless)"),
    ("--cloud-preview-threshold", "cloud_preview_threshold", float, "least confidence of an early verdict worth "
                                                                   "pre-drafting from, 0..1 (default 0.6)"),
    ("--engine", "engine", str, "engine factory 'module:callable' (advanced)"),
]


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "join", help="run the daemon (create or join a home on first use)",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--config", type=Path, default=None,
                   help="TOML config file (default /etc/meshd/meshd.toml if present)")
    first = p.add_mutually_exclusive_group()
    first.add_argument("--new-home", metavar="NAME", help="create a new home with this device as first member")
    first.add_argument("--token", metavar="TOKEN", help="join the home that issued this invite token")
    p.add_argument("--setup-only", action="store_true",
                   help="create (--new-home) or join (--token) the home, or check that the state dir holds "
                        "one, then exit without serving (the one-off step before 'systemctl enable --now meshd')")
    for flag, dest, typ, help_text in _FLAGS:
        p.add_argument(flag, dest=f"cfg_{dest}", type=typ, default=None, help=help_text,
                       metavar=flag.strip("-").upper().replace("-", "_"))
    p.add_argument("--require-keys", dest="cfg_require_keys", action="store_true", default=None,
                   help="every TCP listener needs an API key, loopback ones (--api-listen, --http "
                        "127.0.0.1:PORT) too, so a key can be tried on this machine; the unix socket "
                        "needs none")
    p.add_argument("--debug-responses", dest="cfg_debug_responses", action="store_true", default=None,
                   help="replies carry internal notes (why speculation fell back; they may quote file paths)")
    # Own copies of the logging flags: a daemon logs to stdout and picks its format by
    # where that goes (auto), while other commands default to console lines on stderr.
    p.add_argument("--log-format", dest="cfg_log_format", choices=["auto", "json", "console", "journald"],
                   default=None, help="auto (default: journald under systemd, console on a terminal, "
                                      "json otherwise), json, console or journald")
    p.add_argument("--log-level", dest="cfg_log_level", default=None, help="default info")
    p.set_defaults(func=run)


def overrides_from_args(args) -> dict:
    return {k[4:]: v for k, v in vars(args).items() if k.startswith("cfg_")}


def run(args) -> int:
    cfg = load_config(args.config, os.environ, overrides_from_args(args))
    log.configure(cfg.log_format, cfg.log_level, stream=sys.stdout)
    if cfg.model_enabled:  # say now, in one line, if this machine cannot run --device (before a token is spent)
        placement_of(cfg)
    state = StateDir(cfg.resolved_state_dir()).ensure()
    structlog.contextvars.bind_contextvars(node=state.node_id())
    if cfg.state_dir is None and (note := legacy_state_dir_note()):
        log.get_logger("meshd.join").warning("state_dir_from_an_earlier_release", state_dir=str(state.root), hint=note)
    if args.token and not args.setup_only:
        check_can_listen(cfg)  # an invite token is single-use: never spend it on a daemon that cannot start
    prepare_home(state, cfg, new_home=args.new_home, token=args.token)
    if args.setup_only:
        log.get_logger("meshd.join").info("setup_done", home=state.home().name, state_dir=str(state.root),
                                          next="start the daemon: systemctl enable --now meshd, or meshd join")
        return 0
    from meshd.daemon import Daemon

    return asyncio.run(Daemon(cfg).run())


SECOND_DAEMON_HINT = ("a second meshd on this machine needs its own --state-dir and --socket, "
                      "and --port 0 --pairing-port 0 (any free ports)")


def check_can_listen(cfg) -> None:
    """Bind (and release) every port and the socket the daemon will use, or say what is in the way.

    Run before an invite token is consumed: the daemon binds for real right
    after, so only a program grabbing a port in that instant can still fail it.
    """
    import errno
    import socket

    from meshd.api.listen import bind_error, parse_listen

    wanted = [(cfg.listen, cfg.port, "--port"), (cfg.listen, cfg.pairing_port, "--pairing-port")]
    for spec, flag in ((cfg.api_listen, "--api-listen"), (cfg.http, "--http")):
        if spec:
            host, port = parse_listen(spec, flag=flag, loopback_only=flag == "--api-listen")
            wanted.append((host, port, flag))
    for host, port, flag in wanted:
        if not port:
            continue
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            socket.create_server((host, port), family=family).close()
        except OSError as exc:
            if flag in ("--api-listen", "--http"):
                why = bind_error(exc, flag, port)
            else:
                hint = f"; {SECOND_DAEMON_HINT}" if exc.errno == errno.EADDRINUSE else ""
                why = f"{os.strerror(exc.errno) if exc.errno else exc}{hint}"
            raise MeshdError(f"cannot listen on {host}:{port} ({flag}): {why}; "
                             f"the invite token was not used") from None
    path = cfg.resolved_socket()
    if path.exists():
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(str(path))
        except OSError:
            pass  # stale: the daemon replaces it
        else:
            raise MeshdError(f"another meshd is already serving on {path}; {SECOND_DAEMON_HINT}; "
                             f"the invite token was not used")
        finally:
            s.close()


def prepare_home(state: StateDir, cfg, new_home: str | None, token: str | None) -> None:
    """Create or pair into a home before the daemon starts (both are one-time steps)."""
    logger = log.get_logger("meshd.join")
    home = state.home()
    if new_home:
        if home is not None:
            if home.name == new_home:
                return  # re-running the first-time command is harmless
            raise MeshdError(f"this device already belongs to home {home.name!r}")
        home = state.create_home(new_home)
        logger.info("home_created", home=home.name)
        return
    if token:
        if home is not None:
            raise MeshdError(f"this device already belongs to home {home.name!r}; "
                             "--token is for devices that are not in a home yet")
        from meshd.mesh.pairing import Token, join_with_token
        from meshd.state import Member

        parsed = Token.decode(token)
        node_id = state.node_id()
        public_key = state.keypair().public.decode()
        home, members = asyncio.run(join_with_token(parsed, node_id, cfg.name, public_key))
        state.add_members([*members, Member(node_id, cfg.name, public_key)])
        state.set_home(home)
        logger.info("home_joined", home=home.name, members=len(members))
        return
    if home is None:
        raise MeshdError("this device is not in a home yet: run 'meshd join --new-home NAME' on the "
                         "first device, or 'meshd join --token TOKEN' with a token from 'meshd invite'")
