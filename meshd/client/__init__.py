"""A small client for apps talking to meshd over its unix socket (or its TCP listener).

Two flavours with the same methods — :class:`MeshdClient` (blocking) and
:class:`AsyncMeshdClient` (asyncio) — both on httpx, which speaks HTTP over a
unix socket as well as TCP, so an asyncio app does not block its loop. HTTP
is parsed by httpx; this module only speaks the OpenAI JSON and server-sent
events on top. ``base_url="http://host:11434"`` with ``api_key=`` reaches a
daemon's ``--http`` listener from another machine.

    from meshd.client import MeshdClient
    with MeshdClient() as c:
        for piece in c.chat("Why is the sky blue?", stream=True):
            print(piece, end="", flush=True)

Any OpenAI client works too (see the README), this one just knows where the
socket is and says clearly when no daemon is running.

Inside: :mod:`.wire` reads and writes the OpenAI JSON and server-sent events
(the same for both flavours), :mod:`.target` says where requests go and why
they could not get there, :mod:`.sync` and :mod:`.aio` are the two clients.
"""

from meshd.client.aio import AsyncChatStream, AsyncMeshdClient
from meshd.client.errors import ApiError, DaemonNotRunning
from meshd.client.sync import ChatStream, MeshdClient
from meshd.client.target import DEFAULT_TIMEOUT_S
from meshd.client.wire import Completion, Messages

__all__ = [
    "DEFAULT_TIMEOUT_S", "ApiError", "AsyncChatStream", "AsyncMeshdClient", "ChatStream", "Completion",
    "DaemonNotRunning", "MeshdClient", "Messages",
]
