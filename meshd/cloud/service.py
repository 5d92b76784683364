"""``meshd cloud serve``: the verifier role — a model, its sessions, a CURVE endpoint, pairing.

The same package as the home daemon, its own role and state directory. Every
home reaches it over CURVE; only keys admitted by pairing get past the
handshake. Requests go to :class:`meshd.cloud.verifier.Verifier`; its
refusals (busy, evicted, bad_request) become ``ErrorReply`` with that code, so
the home knows at once what to do, and the endpoint keeps serving others.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from decoding.speculative.draft_model import tokenizer_fingerprint
from meshd.cloud.pairing import CloudPairingServer, admit_home_keys
from meshd.cloud.verifier import MAX_QUEUE, Verifier, VerifierRefusal
from meshd.engine.base import model_id_of
from meshd.log import get_logger
from meshd.state import StateDir
from meshd.mesh.pairing import PairingError
from transport.cloud_messages import CloudClose, CloudMembers, CloudVerify
from transport.messages import Ack, ErrorReply
from transport.node import TransportNode
from transport.wire import Limits

log = get_logger("meshd.cloud.service")

DEFAULT_PORT = 5730
DEFAULT_PAIRING_PORT = 5731
# A verification is tiny; a session's first request carries its prompt (64k tokens = 256 KiB). Beyond the
# header limit a request gets a protocol error; beyond 1 MiB libzmq drops the connection before reading it.
CLOUD_LIMITS = Limits(max_header_bytes=256 * 1024, max_frames=1, max_tensor_bytes=0, max_total_bytes=1024 * 1024)


class VerifierService:
    def __init__(self, source, state_dir: str | Path, *, listen: str = "0.0.0.0", port: int = DEFAULT_PORT,
                 pairing_port: int = DEFAULT_PAIRING_PORT, kv_budget_tokens: int = 16384,
                 max_queue: int = MAX_QUEUE, batched: bool = True, stage=None):
        self.source = source
        self.state = StateDir(Path(state_dir)).ensure()
        self.listen, self.port, self.pairing_port = listen, port, pairing_port
        self.kv_budget_tokens = kv_budget_tokens
        self.max_queue = max_queue
        self.batched = batched
        self._stage = stage
        self.verifier: Verifier | None = None
        self.node: TransportNode | None = None
        self.pairing: CloudPairingServer | None = None
        self.address = ""
        self.model_id = model_id_of(source)
        self.tokenizer = tokenizer_fingerprint(source.tokenizer)
        self.started = time.time()

    async def start(self) -> "VerifierService":
        if self._stage is None:
            n = self.source.config.num_layers
            self._stage = await asyncio.to_thread(self.source.load_stage, 0, n)
        self.verifier = Verifier(self._stage, kv_budget_tokens=self.kv_budget_tokens, max_queue=self.max_queue,
                                 batched=self.batched)
        self.verifier.start()
        self.node = TransportNode("cloud-" + self.state.node_id(), keypair=self.state.keypair(),
                                  allowlist=self.state.allow_list(), limits=CLOUD_LIMITS)
        await self.node.start()
        # More in flight than the queue holds: a full queue answers "busy" instead of making ZeroMQ push back.
        server = await self.node.serve(self._handle, f"tcp://{self.listen}:{self.port}",
                                       max_inflight=2 * self.max_queue + 16)
        self.address = server.address
        self.port = int(self.address.rsplit(":", 1)[1])
        self.pairing = CloudPairingServer(self.state, lambda: {"port": self.port, "model": self.model_id,
                                                               "tokenizer": self.tokenizer})
        self.pairing_port = await self.pairing.start(self.listen, self.pairing_port)
        log.info("cloud_verifier_ready", address=self.address, pairing_port=self.pairing_port,
                 model=self.model_id, homes_admitted=len(self.state.allow_list()))
        return self

    async def _handle(self, msg, req):
        assert self.verifier is not None
        match msg:
            case CloudVerify():
                try:
                    return await self.verifier.submit(req.peer_key or "", msg)
                except VerifierRefusal as exc:
                    return ErrorReply(exc.code, str(exc))
            case CloudClose():
                self.verifier.close_session(req.peer_key or "", msg.session)
                return None
            case CloudMembers():
                try:
                    return Ack(detail=str(admit_home_keys(self.state, req.peer_key or "", msg.keys)))
                except PairingError as exc:
                    log.warning("cloud_home_keys_refused", error=str(exc))
                    return ErrorReply("forbidden", str(exc))
                except ValueError as exc:
                    log.warning("cloud_home_keys_refused", error=str(exc))
                    return ErrorReply("bad_request", str(exc))
        return ErrorReply("unknown_type", f"a verifier does not handle {type(msg).__name__}")

    def status(self) -> dict:
        return {"address": self.address, "pairing_port": self.pairing_port, "model": self.model_id,
                "homes_admitted": len(self.state.allow_list()), "uptime_s": round(time.time() - self.started),
                **(self.verifier.status() if self.verifier else {})}

    async def close(self) -> None:
        if self.pairing is not None:
            await self.pairing.stop()
        if self.node is not None:
            await self.node.close()
        if self.verifier is not None:
            await self.verifier.close()
