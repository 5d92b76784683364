"""The base of every user-facing error of the partitioner.

``partition`` never imports ``meshd``; the layer above lists ``PartitionError``
among its user-facing errors so the CLI prints these as one line.
"""


class PartitionError(Exception):
    """A profile, link spec or plan that cannot be used, or no feasible partition."""
