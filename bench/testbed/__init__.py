"""Multi-host testbed: emulate several home devices on one Linux machine.

``Testbed(n, LinkSpec.parse("100mbit,4ms"))`` gives N hosts as network
namespaces on one bridge, links shaped with ``tc tbf`` and RTT added by a
user-space :class:`DelayProxy` (this kernel has no netem). Without root it falls
back to loopback processes. ``python -m bench.testbed selftest|cleanup``.
"""

from bench.testbed.delay_proxy import DelayProxy
from bench.testbed.linkspec import LinkSpec, LinkSpecError
from bench.testbed.netns import TestbedError, cleanup
from bench.testbed.testbed import FALLBACK_LINE, Host, Testbed, TestbedBusy

__all__ = [
    "DelayProxy",
    "FALLBACK_LINE",
    "Host",
    "LinkSpec",
    "LinkSpecError",
    "Testbed",
    "TestbedBusy",
    "TestbedError",
    "cleanup",
]
