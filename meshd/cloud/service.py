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

from decoding.exits.heads import ExitHeads
from decoding.exits.previews import PreviewExits
from decoding.speculative.draft_model import tokenizer_fingerprint
from meshd.cloud.pairing import CloudPairingServer, admit_home_keys
from meshd.cloud.verifier import MAX_QUEUE, Verifier, VerifierRefusal
from meshd.engine.base import model_id_of
from meshd.model.heads import preview_heads_for
from meshd.log import get_logger
from meshd.state import StateDir
from meshd.mesh.pairing import PairingError
from transport.cloud_messages import CloudClose, CloudHello, CloudMembers, CloudPreview, CloudVerify
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
                 max_queue: int = MAX_QUEUE, batched: bool = True, stage=None,
                 previews: ExitHeads | None | str = "shipped", preview_layers: list[int] | None = None):
        self.source = source
        self.state = StateDir(Path(state_dir)).ensure()
        self.listen, self.port, self.pairing_port = listen, port, pairing_port
        self.kv_budget_tokens = kv_budget_tokens
        self.max_queue = max_queue
        self.batched = batched
        self._stage = stage
        self._previews = previews  # exit heads, None (no previews) or "shipped" (the model's, if meshd ships them)
        self._preview_layers = preview_layers  # which of their exits (default all)
        self.server = None
        self.verifier: Verifier | None = None
        self.node: TransportNode | None = None
        self.pairing: CloudPairingServer | None = None
        self.address = ""
        self.model_id = model_id_of(source)
        self.tokenizer = tokenizer_fingerprint(source.tokenizer)
        self.started = time.time()
        self._push_tasks: set[asyncio.Task] = set()

    async def start(self) -> "VerifierService":
        if self._stage is None:
            n = self.source.config.num_layers
            self._stage = await asyncio.to_thread(self.source.load_stage, 0, n)
        self.verifier = Verifier(self._stage, kv_budget_tokens=self.kv_budget_tokens, max_queue=self.max_queue,
                                 batched=self.batched, previews=self._preview_exits())
        self.verifier.start()
        self.node = TransportNode("cloud-" + self.state.node_id(), keypair=self.state.keypair(),
                                  allowlist=self.state.allow_list(), limits=CLOUD_LIMITS)
        await self.node.start()
        # More in flight than the queue holds: a full queue answers "busy" instead of making ZeroMQ push back.
        server = await self.node.serve(self._handle, f"tcp://{self.listen}:{self.port}",
                                       max_inflight=2 * self.max_queue + 16)
        self.server = server
        self.address = server.address
        self.port = int(self.address.rsplit(":", 1)[1])
        self.pairing = CloudPairingServer(self.state, lambda: {"port": self.port, "model": self.model_id,
                                                               "tokenizer": self.tokenizer})
        self.pairing_port = await self.pairing.start(self.listen, self.pairing_port)
        log.info("cloud_verifier_ready", address=self.address, pairing_port=self.pairing_port,
                 model=self.model_id, homes_admitted=len(self.state.allow_list()),
                 previews_at=self.verifier.preview_layers or None)
        return self

    async def _handle(self, msg, req):
        assert self.verifier is not None
        match msg:
            case CloudVerify():
                try:
                    return await self.verifier.submit(req.peer_key or "", msg, self._previewer(msg, req))
                except VerifierRefusal as exc:
                    return ErrorReply(exc.code, str(exc))
            case CloudHello():
                return CloudHello(previews_at=list(self.verifier.preview_layers))
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

    def _previewer(self, msg: CloudVerify, req):
        """Where a request's previews go: pushed to its home's connection as they come (None: not asked)."""
        if msg.previews <= 0 or self.server is None:
            return None
        server, identity, tasks = self.server, req.identity, self._push_tasks

        def push(p) -> None:
            task = asyncio.ensure_future(server.push(identity, CloudPreview(
                msg.session, msg.start + len(msg.tokens) // 4, p.accepted, p.token, round(p.confidence, 4), p.layer)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        return push

    def _preview_exits(self) -> PreviewExits | None:
        heads = self._previews
        if isinstance(heads, str):  # "shipped"
            cfg = self.source.config
            heads = preview_heads_for(self.source.identity, num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
                                      vocab_size=cfg.vocab_size)
        return None if heads is None else PreviewExits(heads, self._stage, self._preview_layers)

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
