"""The ids that cross module boundaries, as ``NewType``s, defined once for the code base.

They live in the lowest package that needs them (``partition`` has no heavy
imports), so ``meshd``, ``partition`` and anything below can share them without
importing ``meshd``. A ``NewType`` costs nothing at run time; it lets a type
checker tell a node id from any other string and a plan version from any int.
"""

from __future__ import annotations

from typing import NewType

NodeId = NewType("NodeId", str)
"""A device in the home: a daemon's node id, which is also its profile's ``device_id``."""

PlanVersion = NewType("PlanVersion", int)
"""The mesh's monotonic plan counter; every pipeline message carries the one it was computed for."""

SeqKey = NewType("SeqKey", str)
"""A home-wide sequence key ``<coordinator node id>/<incarnation>/<n>`` (minted by
:class:`meshd.pipeline.seqkey.SeqKeys`)."""

RequestId = NewType("RequestId", str)
"""One generation a client asked for, named by the API that took it (``chatcmpl-…``,
``cmpl-…``, ``ollama-…``; an outline point adds ``/p<k>``). It is the OpenAI response's
``id`` too, and follows the request through the engine, the coordinator and every
stage's log lines; a replay on a new plan keeps it (its sequences change)."""

CallId = NewType("CallId", int)
"""One call on one link (``transport.messages.Envelope.call_id``, wire key ``request_id``): matches a reply to
the message that asked for it; 0 means one-way. Nothing above the link ever sees it."""

CloudSession = NewType("CloudSession", int)
"""One answer a home drafts for a cloud verifier (``CloudVerify.session``), numbered by
the home; the verifier keys its cache by (home key, session) so homes never collide."""
