"""This device's own facts, as its heartbeats and status tell them to the home.

Kept apart from the view of the others because this device's facts have one writer each
(the model host sets the load state and model, the stage its port), while members' facts
only ever arrive in heartbeats.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any

from meshd.state import json_digest
from partition.ids import NodeId


def meshd_version() -> str:
    from meshd import __version__

    return __version__


class LocalMember:
    def __init__(self, name: str, memory_budget_mb: int, load_state: str,
                 clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.node_id = NodeId("")
        self.public_key = ""
        self.name = name
        self.memory_budget_mb = memory_budget_mb
        self.load_state = load_state  # "loading" | "fetching" | "loaded" | "failed" | "none"
        self.last_error = ""  # shown per member by `meshd status` (sent in heartbeats)
        self.own_profile: dict[str, Any] | None = None
        self.profile_how = ""  # how this device came by the profile it is planned with (set once the model is open)
        self.mode_how = ""  # the numeric mode this device serves in and why (set once the model is open)
        self.stage_port = 0  # set by the model host once the serving role's stage listens
        self.group_port = 0  # where this device takes a tensor group's links (the serving role's)
        self.port = 0  # the control link's transport port
        self.pairing_port = 0
        self.incarnation = secrets.token_hex(6)  # peers see a restart as a new incarnation
        self.started_at = 0.0
        self.model_source: Any = None  # the opened model file (set by the model host)
        self._identity: tuple[Any, str, int] | None = None

    def model_identity(self) -> tuple[str, int]:
        """(identity of the loaded model file, its layer count); ("", 0) for model-less engines."""
        source = self.model_source
        if source is None:
            return "", 0
        if self._identity is None or self._identity[0] is not source:
            ident = str(getattr(source, "identity", "") or "")
            layers = int(getattr(getattr(source, "config", None), "num_layers", 0) or 0)
            self._identity = (source, ident, layers)
        return self._identity[1], self._identity[2]

    def profile_digest(self) -> str:
        return json_digest(self.own_profile) if self.own_profile else ""

    def uptime_s(self) -> float:
        return round(self.clock() - self.started_at, 1) if self.started_at else 0.0

    def note_error(self, error: str) -> None:
        self.last_error = error
