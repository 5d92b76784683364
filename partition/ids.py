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
