"""Partitioning the model over a home's devices (Jupiter-style, offline and pure).

- ``profile``   DeviceProfile: per-device measurements as versioned JSON; interpolation; scaling
- ``profiler``  measures a device through the stage runtime (``meshd profile``)
- ``link``      link model: ``"100mbit,2ms"`` → bytes/bandwidth + RTT
- ``layers``    layer DP over device subsets and orders, memory limits, bottleneck reasons
- ``sequence``  vectorised sub-sequence (chunk) DP and the O(1) cut table
- ``plan``      Plan / StageAssignment (half-open ``[first, end)``) / CutTable: what the daemon broadcasts
- ``ids``       the NewType ids that cross modules: NodeId, PlanVersion, SeqKey
- ``planner``   make_plan (layers, then chunks) and predictions from a plan
- ``synthetic`` analytic profiles for tests and benchmarks
"""
