"""Daemon configuration: one typed dataclass, four layers of precedence.

defaults < TOML file < ``MESHD_*`` environment < command-line flags.

The layering is a pure function (:func:`load_config`) of its inputs so it can be
tested without touching the real environment; systemd units and containers
set environment variables, humans pass flags, and packagers ship the TOML.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket as _socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshd.errors import MeshdError
from meshd.paths import default_socket_path, default_state_dir
from partition.errors import PartitionError
from partition.link import DEFAULT_LINK, parse_link

DEFAULT_CONFIG_PATH = Path("/etc/meshd/meshd.toml")
# The spellings decoding.device accepts, repeated so reading a config never imports torch.
_DEVICE_RE = re.compile(r"auto|cpu|cuda(?::\d+)?")
_DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
_WEIGHT_NAMES = ("float32", "bfloat16", "float16", "packed", "packed4", "gguf")
DEFAULT_PORT = 7410
DEFAULT_PAIRING_PORT = 7411


class ConfigError(MeshdError):
    """The configuration file, an environment variable or a flag is invalid."""


def _default_memory_budget_mb() -> int:
    """Half of physical memory: the device is someone's laptop, not a server."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 1024
    return max(256, int(total / 2 / 2**20))


@dataclass
class Config:
    state_dir: Path | None = None  # None: $MESHD_HOME, $STATE_DIRECTORY or ~/.local/state/meshd
    socket: Path | None = None  # None: meshd.paths.default_socket_path()
    name: str = field(default_factory=_socket.gethostname)  # human-readable device name
    listen: str = "0.0.0.0"  # address the transport and pairing endpoints bind
    port: int = DEFAULT_PORT  # transport (CURVE) port; 0 = any free port
    pairing_port: int = DEFAULT_PAIRING_PORT  # token pairing port; 0 = any free port
    interface: str | None = None  # restrict mDNS + advertised address: name or IP
    heartbeat_interval_s: float = 1.0
    suspect_after_s: float = 3.0  # no heartbeat for this long: suspect
    gone_after_s: float = 6.0  # no heartbeat for this long: gone
    replan_debounce_s: float = 1.0
    memory_budget_mb: int = field(default_factory=_default_memory_budget_mb)
    model: str | None = None  # None: embedded default; "none": no model (control plane only)
    device: str = "auto"  # where this device's stage computes: auto (CUDA if available), cpu, cuda, cuda:N
    weights: str | None = None  # numeric mode: auto (gguf or packed on a CPU, bfloat16/float16 on a GPU), float32,
    #                              bfloat16, float16, packed, packed4, gguf; the leader's is the plan's, for every member
    dtype: str | None = None  # older spelling of a dense mode (float32, bfloat16, float16); weights wins
    wire_dtype: str = "float32"  # activations this stage sends on: float16/bfloat16 halve the bytes per hop
    self_profile: str = "quick"  # no profile of this model yet: "quick" times one layer at start-up; "off"
    plan_layers: int = 30  # layer count planned for engines without a model file (test fakes)
    request_wait_s: float = 45.0  # a request waits this long for a plan (start-up, re-plan) before a 503
    share_rate: str | None = None  # cap on model sharing per direction ("50mbit", "12.5MB/s"; None: none)
    share_fetch: str = "layers"  # no local model: fetch "layers" (only this device's) or the "whole" file; "off"
    medusa_heads: str | None = None  # Medusa heads file; None: the shipped heads of the embedded model; "none": off
    draft_model: str | None = None  # a smaller model of the same family, for speculative drafter "draft_model"
    # Early exits (Synera; lossy): a request that does not say decodes with this top-2 margin threshold
    # (0: off); ``exit_heads``: their file (None: the ones shipped with the embedded model; "none": off).
    exit_threshold: float = 0.0
    exit_heads: str | None = None
    # Finished requests' KV kept in every stage for later prompts that start the same way (Home Assistant
    # resends one long system prompt): the share of each stage's KV budget it may hold; 0 turns it off.
    prefix_cache_share: float = 0.5
    # Prompts whose prefix is never evicted once computed: files holding the text, or a JSON chat request
    # ({"messages": [...], "tools": [...]}) rendered with the model's chat template.
    pin_prompts: list[str] = field(default_factory=list)
    # How the home lays the model out: "auto" (priced per workload: whole-model replicas, one pipeline, a
    # tensor-parallel group in the gguf mode, or a mix), "pipeline" (every member holds a layer range of one
    # pipeline), "replicas" (every member that holds the whole model runs it alone), "tensor" (members
    # split every layer between them). The leader's setting decides.
    layout: str = "auto"
    # The link between members the leader prices its layouts over (BANDWIDTH[,RTT]): the default is a home
    # Wi-Fi hop; a wired LAN ("1gbit,0.3ms") lets it choose a tensor group where one pays. `meshd status`
    # shows each link's measured round trip to set it by.
    link: str = DEFAULT_LINK
    cloud_budget: float = 0.2  # share of drafted chunks a paired cloud verifier checks (0..1; 1 = every one)
    cloud_min_timeout_s: float = 1.0  # the shortest wait for a verdict before the chunk is committed locally
    cloud_previews: int = 0  # pre-drafts a round may start from a verifier's early verdicts (0: off)
    cloud_preview_threshold: float = 0.6  # the least confidence of an early verdict worth pre-drafting from
    invite_ttl_s: float = 15 * 60
    drain_timeout_s: float = 10.0  # SIGTERM: time in-flight requests get to finish
    api_listen: str | None = None  # also serve the API on loopback TCP, "127.0.0.1:8080"
    http: str | None = None  # the API on TCP for the LAN, "0.0.0.0:11434"; off loopback it needs API keys
    tls_cert: Path | None = None  # PEM certificate chain: --http speaks HTTPS
    tls_key: Path | None = None  # PEM private key for tls_cert
    require_keys: bool = False  # every TCP listener needs an API key, loopback ones too (not the unix socket)
    # Other names requests may give the served model (Ollama's "llama3.2:3b", OpenAI's "gpt-4o-mini"): unknown
    # names get a 404 (Ollama's "model not found", OpenAI's model_not_found) unless listed here; "*" accepts any.
    # Listed in /v1/models and /api/tags; Ollama replies echo the alias asked, OpenAI replies the served model.
    model_aliases: list[str] = field(default_factory=list)
    debug_responses: bool = False  # replies carry internal notes (why speculation fell back; may quote paths)
    engine: str | None = None  # "module:factory" returning the Engine (seam for the pipeline)
    log_format: str = "auto"  # auto: journald under systemd, console on a terminal, json otherwise
    log_level: str = "info"

    def resolved_state_dir(self, env: Mapping[str, str] | None = None) -> Path:
        env = os.environ if env is None else env
        return Path(self.state_dir).expanduser() if self.state_dir else default_state_dir(env)

    def resolved_socket(self, env: Mapping[str, str] | None = None) -> Path:
        env = os.environ if env is None else env
        if self.socket:
            return Path(self.socket).expanduser()
        return default_socket_path(env)

    @property
    def model_enabled(self) -> bool:
        return (self.model or "").lower() != "none"

    def validate(self) -> Config:
        if not (0 < self.heartbeat_interval_s < self.suspect_after_s < self.gone_after_s):
            raise ConfigError(
                "need 0 < heartbeat_interval_s < suspect_after_s < gone_after_s, got "
                f"{self.heartbeat_interval_s}, {self.suspect_after_s}, {self.gone_after_s}"
            )
        for key in ("port", "pairing_port"):
            if not 0 <= getattr(self, key) < 65536:
                raise ConfigError(f"{key} must be a TCP port, got {getattr(self, key)}")
        if self.log_format not in ("auto", "json", "console", "journald"):
            raise ConfigError(f"log_format must be auto, json, console or journald, got {self.log_format!r}")
        if not 0.0 < self.cloud_min_timeout_s <= 3600.0:
            raise ConfigError(f"cloud_min_timeout_s must be in (0, 3600], got {self.cloud_min_timeout_s}")
        if not 0.0 <= self.prefix_cache_share <= 1.0:
            raise ConfigError(f"prefix_cache_share must be between 0 and 1, got {self.prefix_cache_share}")
        if self.layout not in ("auto", "pipeline", "replicas", "tensor"):
            raise ConfigError(f"layout must be auto, pipeline, replicas or tensor, got {self.layout!r}")
        self.link = str(self.link).strip().lower()
        try:
            parse_link(self.link)
        except PartitionError as exc:
            raise ConfigError(f"link: {exc}") from None
        self.pin_prompts = [str(p).strip() for p in self.pin_prompts if str(p).strip()]
        if not 0.0 <= self.exit_threshold <= 1.0:
            raise ConfigError(f"exit_threshold must be between 0 (off) and 1, got {self.exit_threshold}")
        if not 0.0 <= self.cloud_budget <= 1.0:
            raise ConfigError(f"cloud_budget must be between 0 and 1, got {self.cloud_budget}")
        if not 0 <= self.cloud_previews <= 16:
            raise ConfigError(f"cloud_previews must be between 0 (off) and 16, got {self.cloud_previews}")
        if not 0.0 < self.cloud_preview_threshold <= 1.0:
            raise ConfigError(f"cloud_preview_threshold must be in (0, 1], got {self.cloud_preview_threshold}")
        # Spelling only: whether CUDA is there is asked when the stage starts (torch is not imported here).
        if not _DEVICE_RE.fullmatch(str(self.device).strip().lower()):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.dtype is not None and str(self.dtype).strip().lower() not in _DTYPE_NAMES:
            raise ConfigError(f"dtype must be {', '.join(_DTYPE_NAMES)}, got {self.dtype!r}")
        if self.weights is not None and str(self.weights).strip().lower() not in ("auto", *_WEIGHT_NAMES):
            raise ConfigError(f"weights must be auto, {', '.join(_WEIGHT_NAMES)}, got {self.weights!r}")
        self.wire_dtype = str(self.wire_dtype).strip().lower()
        if self.wire_dtype not in _DTYPE_NAMES[1:]:
            raise ConfigError(f"wire_dtype must be {', '.join(_DTYPE_NAMES[1:])}, got {self.wire_dtype!r}")
        self.model_aliases = [str(a).strip() for a in self.model_aliases if str(a).strip()]
        if any(len(a) > 512 for a in self.model_aliases):
            raise ConfigError("model_aliases: a model name is at most 512 characters")
        self.self_profile = str(self.self_profile).strip().lower()
        if self.self_profile not in ("quick", "off"):
            raise ConfigError(f"self_profile must be quick or off, got {self.self_profile!r}")
        return self


def placement_of(cfg: Config | None):
    """The stage's device and dtype this configuration asks for (``decoding.device.Placement``);
    raises its one-line error when this machine cannot give it. Imports torch, so only on use."""
    from decoding.device import Placement

    return Placement.resolve(getattr(cfg, "device", "auto"), getattr(cfg, "dtype", None), getattr(cfg, "weights", None))


FIELDS = {f.name: f for f in dataclasses.fields(Config)}


def _coerce(key: str, value: Any, source: str) -> Any:
    """Convert a TOML/env/flag value to the field's type, with a clear error."""
    ftype = str(FIELDS[key].type)
    try:
        if value is None:
            return None
        if "list" in ftype:
            if isinstance(value, str):
                return [v.strip() for v in value.split(",") if v.strip()]
            return [str(v) for v in value]
        if ftype.startswith("Path"):
            return Path(str(value)).expanduser()
        if ftype == "bool":
            if isinstance(value, bool):
                return value
            low = str(value).strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if ftype == "int":
            if isinstance(value, bool):
                raise ValueError(value)
            return int(value)
        if ftype == "float":
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: invalid value {value!r} for {key} ({ftype})") from None


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        return {}
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    # Accept both a flat file and one with a [meshd] table.
    if isinstance(data.get("meshd"), dict):
        data = {**{k: v for k, v in data.items() if k != "meshd"}, **data["meshd"]}
    return data


def load_config(
    path: Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Build the effective Config.

    ``path`` None means the default file, which may be absent; an explicit path
    that does not exist is an error. ``overrides`` are flags: keys whose value
    is None are "not given" and do not override anything.
    """
    env = os.environ if env is None else env
    if path is None:
        path_env = env.get("MESHD_CONFIG")
        explicit = bool(path_env)
        path = Path(path_env) if path_env else DEFAULT_CONFIG_PATH
    else:
        explicit = True
    if explicit and not Path(path).is_file():
        raise ConfigError(f"config file not found: {path}")
    cfg = Config()
    values: dict[str, Any] = {}
    for key, value in read_toml(Path(path)).items():
        if key not in FIELDS:
            raise ConfigError(f"{path}: unknown setting {key!r}")
        values[key] = _coerce(key, value, str(path))
    for key in FIELDS:
        env_key = "MESHD_" + key.upper()
        if env_key in env and key != "socket":  # MESHD_SOCKET is read by meshd.paths
            values[key] = _coerce(key, env[env_key], env_key)
    for key, value in (overrides or {}).items():
        if value is not None:
            values[key] = _coerce(key, value, "--" + key.replace("_", "-"))
    return dataclasses.replace(cfg, **values).validate()
