"""One member's part in the home's cloud pairing: hold the newest record, use what it names.

The daemon feeds it what happens — a heartbeat naming a peer's record, a
record a peer sent, ``cloud.json`` changed by ``meshd cloud pair``/``unpair``,
the home's keys changed — and it answers with what to send. It connects to
the verifier the newest record names (and drops a verifier that was unpaired)
without a restart; requests already running keep the link they started with
and finish locally if it closes under them. Once connected it vouches for the
home's member keys, so a device that joined after the pairing is admitted too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from decoding.offload.loop import PreviewSettings
from meshd.mesh import control
from meshd.cloud.held import held_record, save_record
from meshd.cloud.record import CloudRecord, heartbeat_key, newer
from meshd.log import get_logger
from meshd.state import StateDir, StateError

log = get_logger("meshd.cloud.sync")

VOUCH_TIMEOUT_S = 10.0
VOUCH_RETRY_S = 30.0
MAX_CLOCK_AHEAD_S = 86400.0  # a record stamped further ahead would outrank every later pairing: refused


class CloudSync:
    def __init__(self, state: StateDir, budget: float, min_timeout_s: float | None,
                 home_keys: Callable[[], list[str]], on_error: Callable[[str], None],
                 previews: PreviewSettings | None = None):
        self.state = state
        self.budget = budget
        self.previews = previews
        self.min_timeout_s = min_timeout_s
        self.home_keys = home_keys
        self.on_error = on_error
        self.held: CloudRecord | None = None  # read from cloud.json at the first tick or attach
        self.home = None  # meshd.cloud.home.CloudHome while a paired verifier is in use
        self._using: CloudRecord | None = None  # the record self.home was built from
        self._node = None
        self._tokenizer = ""
        self._engine = None
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        self._vouched: frozenset[str] = frozenset()
        self._vouching = False
        self._read_error = ""
        self._rejected = ""  # the last refused record's digest: warn once per record, not per heartbeat
        self._closed = False
        self._error = ""
        self._vouch_after = 0.0  # monotonic: after a failed vouch, wait before the next try

    # -- what the daemon tells it -----------------------------------------------------
    def heartbeat_fields(self) -> dict:
        changed_at, digest = heartbeat_key(self.held)
        return {"cloud_changed_at": changed_at, "cloud_digest": digest}

    def share_for(self, changed_at: float, digest: str) -> control.CloudShare | None:
        """A peer's heartbeat named its record: send ours if it is newer."""
        if self.held is not None and self.held.order > (changed_at, digest):
            return control.CloudShare(self.held.to_json())
        return None

    def receive(self, value: dict, sender: str) -> None:
        """A peer sent its record: keep it if newer than ours, and use it."""
        try:
            record = CloudRecord.from_json(value)
            if record.changed_at > time.time() + MAX_CLOCK_AHEAD_S:
                raise ValueError("the record is stamped more than a day ahead of this member's clock")
        except ValueError as exc:
            if str(value)[:200] != self._rejected:
                log.warning("cloud_record_rejected", sender=sender, error=str(exc))
            self._rejected = str(value)[:200]
            return
        self._pick_up_file()
        if not newer(record, self.held):
            return
        try:
            save_record(self.state, record)
        except (OSError, StateError) as exc:
            log.error("cloud_record_not_saved", sender=sender, error=str(exc))
            return
        self.held = record
        log.info("cloud_record_learned", sender=sender, paired=record.paired, address=record.address or None,
                 model=record.model or None)
        self.kick()

    def tick(self) -> None:
        """Each heartbeat: pick up ``cloud.json`` written by ``meshd cloud pair``/``unpair`` under the
        running daemon, and vouch for member keys the verifier has not been told of."""
        if self._pick_up_file():
            self.kick()
        if (self.home is not None and not self._vouching and time.monotonic() >= self._vouch_after
                and not frozenset(self.home_keys()) <= self._vouched):
            self._spawn(self._vouch())

    async def attach(self, node, tokenizer: str, engine) -> None:
        """The engine is up: from now on records are applied to it (its ``cloud`` attribute)."""
        if self._closed:
            return
        self._node, self._tokenizer, self._engine = node, tokenizer, engine
        self._pick_up_file()
        await self._apply()

    async def close(self) -> None:
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        async with self._lock:
            await self._drop()

    def status(self) -> dict | None:
        """What ``meshd status`` prints: the verifier in use, or the paired one this member cannot use."""
        if self.home is not None:
            return self.home.status()
        if self.held is not None and self.held.paired and self._engine is not None:
            return {"model": self.held.model, "budget": self.budget, "totals": {},
                    "link": {"address": self.held.address, "state": "not connected",
                             "last_error": self._error or "connecting"}}
        return None

    # -- applying ---------------------------------------------------------------------
    def _pick_up_file(self) -> bool:
        record = self._read()
        if record is None or (self.held is not None and record.order == self.held.order):
            return False
        self.held = record
        log.info("cloud_record_changed", paired=record.paired, address=record.address or None)
        return True

    def _read(self) -> CloudRecord | None:
        try:
            record = held_record(self.state)
        except (ValueError, OSError, StateError) as exc:
            if str(exc) != self._read_error:  # once per distinct problem, not every heartbeat
                log.error("cloud_record_unreadable", error=str(exc))
                self.on_error(f"cloud.json unreadable: {exc}"[:300])
            self._read_error = str(exc)
            return None
        self._read_error = ""
        return record

    def kick(self) -> None:
        if self._engine is not None:
            self._spawn(self._apply())

    def _spawn(self, coro) -> None:
        if self._closed:
            coro.close()
            return
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _apply(self) -> None:
        async with self._lock:
            if self._closed:
                return
            want = self.held if self.held is not None and self.held.paired else None
            if want == self._using and (want is None or self.home is not None):
                return
            await self._drop()
            if want is None:
                return
            try:
                from meshd.cloud.home import CloudHome

                if want.tokenizer and want.tokenizer != self._tokenizer:
                    raise ValueError(f"the paired verifier's model ({want.model}) does not share this home's "
                                     "tokenizer; run 'meshd cloud unpair' or pair a matching verifier")
                self.home = await CloudHome.connect(self._node, want.to_json(), self.budget, self.min_timeout_s,
                                                    self.previews)
                self._using = want
                self._vouched = frozenset()
                self._error = ""
            except Exception as exc:  # noqa: BLE001 - the home runs without its verifier rather than not at all
                self._error = f"cloud verifier not used: {exc}"[:300]
                self.on_error(self._error)
                log.error("cloud_verifier_unusable", error=f"{type(exc).__name__}: {exc}")
                return
            self._engine.cloud = self.home
        self._spawn(self._vouch())  # in the background: an unreachable verifier must not hold up start-up

    async def _drop(self) -> None:
        home, self.home, self._using = self.home, None, None
        if home is not None:
            if self._engine is not None:
                self._engine.cloud = None
            await home.close()
            log.info("cloud_verifier_dropped", address=home.link.address)

    async def _vouch(self) -> None:
        home = self.home
        keys = frozenset(self.home_keys())
        if home is None or keys <= self._vouched or self._vouching:
            return
        self._vouching = True
        try:
            added = await home.admit(sorted(keys), VOUCH_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - tried again a while later
            self._vouch_after = time.monotonic() + VOUCH_RETRY_S
            log.warning("cloud_vouch_failed", error=f"{type(exc).__name__}: {exc}", retry_in_s=VOUCH_RETRY_S)
            return
        finally:
            self._vouching = False
        if home is self.home:
            self._vouched = keys
        if added:
            log.info("cloud_home_keys_vouched", added=added, keys=len(keys))
