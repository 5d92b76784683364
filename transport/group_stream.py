"""The sealed byte stream that carries a tensor group's partial sums between two members.

Why not the CurveZMQ link the group forms over: a partial sum is a few kilobytes that the other member's
next half-layer waits for, 57 times a token on a 28-layer model. Through ZeroMQ each one hops from the
compute thread to ZeroMQ's I/O thread and back on both members — on a device whose one core also
computes, that hop is most of the exchange (measured on loopback between two pinned processes: 115 us
an exchange over CurveZMQ, 40 us over this stream, 30 us over bare TCP). Here the compute thread writes
and reads the socket itself.

It is as private as the CurveZMQ link: the two members agree on fresh session keys with libsodium's
``crypto_kx`` from ephemeral key pairs whose public halves travelled over the authenticated CurveZMQ
link (so only the member that link authenticated can derive them), and every frame is sealed with
libsodium's ``secretstream`` (XChaCha20-Poly1305: encrypted, authenticated, and bound to its place in
the stream, so a frame cannot be dropped, replayed or reordered unnoticed). A connection that cannot
open a frame with the right keys is closed. Nothing here is a new cipher or a new protocol: key
exchange and stream sealing are libsodium's, composed the way its documentation describes.

Frames: a 4-byte length, then the sealed message (kind, pass, exchange, payload).
"""

from __future__ import annotations

import socket
import struct
import time
from typing import Callable

import nacl.bindings as sodium

from decoding.tensor_group import GroupLost

_LENGTH = struct.Struct("<I")
HEADER = struct.Struct("<BII")  # kind, pass, exchange within the pass (the group's CurveZMQ messages too)
_PREAMBLE = struct.Struct("<HI")  # the dialling member's rank and plan epoch, in clear (keys are chosen by it)
_STREAM_HEADER = sodium.crypto_secretstream_xchacha20poly1305_HEADERBYTES
KX_PUBLIC_BYTES = sodium.crypto_kx_PUBLIC_KEY_BYTES
#: the first frame each side sends: proves it holds the session keys (a stranger cannot make one)
OPEN = 0
#: a frame larger than this is a broken or hostile stream, not a partial sum (a 2048-row prompt chunk of
#: an 8192-wide model is 64 MiB)
MAX_FRAME = 1 << 30
_FIRST_FRAME_MAX = 256


def sodium_stream_functions() -> tuple[int, int]:
    """The addresses of libsodium's secretstream push and pull, as PyNaCl's libsodium has them."""
    from nacl._sodium import ffi, lib

    return tuple(int(ffi.cast("uintptr_t", ffi.addressof(lib, f"crypto_secretstream_xchacha20poly1305_{name}")))
                 for name in ("push", "pull"))  # type: ignore[return-value]


def _state_address(state) -> int:
    from nacl._sodium import ffi

    return int(ffi.cast("uintptr_t", state.statebuf))


def kx_keypair() -> tuple[bytes, bytes]:
    """A fresh ephemeral key pair for one group's streams (public, secret)."""
    return sodium.crypto_kx_keypair()


class SealedStream:
    """One member's stream to one other member (non-blocking once open): sealed frames out, opened
    frames in, in order."""

    def __init__(self, sock: socket.socket, push_state, pull_state, peer: int):
        self.sock, self.peer = sock, peer
        self._push, self._pull = push_state, pull_state
        self._out = bytearray()
        self._in = bytearray()
        sock.setblocking(False)

    def fileno(self) -> int:
        return self.sock.fileno()

    def seal(self, kind: int, number_pass: int, number: int, payload) -> None:
        """Queue a frame (:meth:`flush` sends it)."""
        sealed = sodium.crypto_secretstream_xchacha20poly1305_push(
            self._push, HEADER.pack(kind, number_pass, number) + bytes(payload))
        self._out += _LENGTH.pack(len(sealed))
        self._out += sealed

    def flush(self) -> bool:
        """Send what the socket takes now; whether everything queued has gone."""
        while self._out:
            try:
                sent = self.sock.send(self._out)
            except (BlockingIOError, InterruptedError):
                return False
            except OSError as exc:
                raise GroupLost(f"group member {self.peer} dropped its link ({exc})") from exc
            del self._out[:sent]
        return True

    def receive(self) -> list[tuple[int, int, int, memoryview]]:
        """The frames complete now (kind, pass, exchange, payload): reads what the socket has."""
        while True:
            try:
                got = self.sock.recv(1 << 20)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                raise GroupLost(f"group member {self.peer} dropped its link ({exc})") from exc
            if not got:
                raise GroupLost(f"group member {self.peer} dropped its link (the stream closed)")
            self._in += got
            if len(got) < (1 << 20):
                break
        frames = []
        at = 0
        while len(self._in) - at >= _LENGTH.size:
            (n,) = _LENGTH.unpack_from(self._in, at)
            if n > MAX_FRAME:
                raise GroupLost(f"group member {self.peer} sent a {n}-byte frame (broken stream)")
            if len(self._in) - at - _LENGTH.size < n:
                break
            frames.append(self._open(bytes(self._in[at + _LENGTH.size: at + _LENGTH.size + n])))
            at += _LENGTH.size + n
        if at:
            del self._in[:at]
        return frames

    def _open(self, sealed: bytes) -> tuple[int, int, int, memoryview]:
        try:
            message, _ = sodium.crypto_secretstream_xchacha20poly1305_pull(self._pull, sealed)
        except Exception as exc:  # noqa: BLE001 - libsodium's refusal, whatever PyNaCl names it
            raise GroupLost(f"a frame from group member {self.peer} failed authentication") from exc
        kind, number_pass, number = HEADER.unpack_from(message)
        return kind, number_pass, number, memoryview(message)[HEADER.size:]

    def native_handles(self) -> tuple[int, int, int]:
        """(socket, push state address, pull state address) for C code that seals and opens this stream's
        frames itself (``decoding/quant/native/group_sum.cpp``) while :meth:`idle`. The states are the very
        memory PyNaCl uses, so frames sealed on either side continue one nonce sequence."""
        return self.sock.fileno(), _state_address(self._push), _state_address(self._pull)

    def idle(self) -> bool:
        """No bytes wait here in either direction (else they must go, or be read, in order first)."""
        return not self._out and not self._in

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def dial(address: tuple[str, int], rank: int, epoch: int, peer: int, own_kx: tuple[bytes, bytes],
         peer_kx: bytes, check: Callable[[], None], connect_timeout_s: float = 30.0) -> SealedStream:
    """Open the stream to lower-ranked ``peer`` (the dialling side is crypto_kx's client). Its answer comes
    when it reaches its own first exchange (it may still be loading): waited for as long as ``check``
    (called every slice; it raises when the group is lost or this member is told to leave) lets it."""
    rx, tx = sodium.crypto_kx_client_session_keys(own_kx[0], own_kx[1], peer_kx)
    try:
        sock = socket.create_connection(address, timeout=connect_timeout_s)
    except OSError as exc:
        raise GroupLost(f"group member {peer}'s stream at {address[0]}:{address[1]} refused: {exc}") from exc
    try:
        _tune(sock)
        push = sodium.crypto_secretstream_xchacha20poly1305_state()
        header = sodium.crypto_secretstream_xchacha20poly1305_init_push(push, tx)
        sock.settimeout(connect_timeout_s)
        sock.sendall(_PREAMBLE.pack(rank, epoch) + header + _first_frame(push))
        pull = sodium.crypto_secretstream_xchacha20poly1305_state()
        sodium.crypto_secretstream_xchacha20poly1305_init_pull(pull, _read_exact(sock, _STREAM_HEADER, check=check), rx)
        _check_first_frame(sock, pull, peer, check=check)
    except OSError as exc:
        sock.close()
        raise GroupLost(f"group member {peer} did not open its stream: {exc}") from exc
    except BaseException:
        sock.close()
        raise
    return SealedStream(sock, push, pull, peer)


def accept(listener: socket.socket, own_kx: tuple[bytes, bytes], peers_kx: dict[int, bytes], epoch: int,
           timeout_s: float) -> SealedStream | None:
    """The next member's stream on ``listener`` (its side is crypto_kx's server), or None when none came
    or a connection was not one of the group's (wrong epoch, unknown rank, a frame that does not open, or
    not all of its opening within ``timeout_s``: a caller cannot hold the group's formation longer)."""
    try:
        sock, _ = listener.accept()
    except OSError:  # nobody called within the listener's timeout (or a failed accept)
        return None
    deadline = time.monotonic() + timeout_s
    try:
        _tune(sock)
        rank, their_epoch = _PREAMBLE.unpack(_read_exact(sock, _PREAMBLE.size, deadline=deadline))
        header = _read_exact(sock, _STREAM_HEADER, deadline=deadline)
        if their_epoch != epoch or rank not in peers_kx:
            sock.close()
            return None
        rx, tx = sodium.crypto_kx_server_session_keys(own_kx[0], own_kx[1], peers_kx[rank])
        pull = sodium.crypto_secretstream_xchacha20poly1305_state()
        sodium.crypto_secretstream_xchacha20poly1305_init_pull(pull, header, rx)
        _check_first_frame(sock, pull, rank, deadline=deadline)
        push = sodium.crypto_secretstream_xchacha20poly1305_state()
        reply = sodium.crypto_secretstream_xchacha20poly1305_init_push(push, tx)
        sock.settimeout(timeout_s)
        sock.sendall(reply + _first_frame(push))
    except (OSError, GroupLost, struct.error):
        sock.close()
        return None
    return SealedStream(sock, push, pull, rank)


def _first_frame(push) -> bytes:
    sealed = sodium.crypto_secretstream_xchacha20poly1305_push(push, HEADER.pack(OPEN, 0, 0))
    return _LENGTH.pack(len(sealed)) + sealed


def _check_first_frame(sock: socket.socket, pull, peer: int, **wait) -> None:
    (n,) = _LENGTH.unpack(_read_exact(sock, _LENGTH.size, **wait))
    if n > _FIRST_FRAME_MAX:
        raise GroupLost(f"group member {peer}'s stream did not open with its first frame")
    try:
        message, _ = sodium.crypto_secretstream_xchacha20poly1305_pull(pull, _read_exact(sock, n, **wait))
    except OSError:
        raise
    except Exception as exc:  # noqa: BLE001 - libsodium's refusal
        raise GroupLost(f"group member {peer}'s stream failed authentication") from exc
    if HEADER.unpack_from(message)[0] != OPEN:
        raise GroupLost(f"group member {peer}'s stream did not open with its first frame")


_CHECK_SLICE_S = 0.2


def _read_exact(sock: socket.socket, n: int, deadline: float | None = None,
                check: Callable[[], None] | None = None) -> bytes:
    """``n`` bytes, all of them by ``deadline`` (then ``socket.timeout``), or for as long as ``check`` lets
    (called between slices)."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("the stream's opening took too long")
            sock.settimeout(min(left, _CHECK_SLICE_S))
        else:
            sock.settimeout(_CHECK_SLICE_S)
        try:
            got = sock.recv(n - len(buf))
        except socket.timeout:
            if check is not None:
                check()
            continue
        if not got:
            raise ConnectionError("the stream closed while opening")
        buf += got
    return bytes(buf)


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a partial sum leaves now, not with the next
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


def listen(host: str, port: int = 0) -> socket.socket:
    """The member's stream listener on ``host`` (``port``, or any port when it is taken or 0)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for p in ([port, 0] if port else [0]):
        s = socket.socket(family, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, p))
        except OSError:
            s.close()
            continue
        s.listen(16)
        return s
    raise GroupLost(f"the group's stream cannot listen on {host}")
