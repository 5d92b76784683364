"""Partitioning the model over a home's devices (Jupiter-style, offline and pure).

- ``profile``   DeviceProfile: per-device measurements as versioned JSON; interpolation; scaling
- ``profiler``  measures a device through the stage runtime (``meshd profile``)
- ``link``      link model: ``"100mbit,2ms"`` → bytes/bandwidth + RTT
- ``layers``    layer DP over device subsets and orders, memory limits, bottleneck reasons
- ``sequence``  vectorised sub-sequence (chunk) DP that builds the cut table
- ``cuttable``  CutTable: a prompt's cut points in O(1), and its compact wire form
- ``plan``      the one Plan type / StageAssignment (half-open ``[first, end)``), and their
                wire form (``layers_v2`` ranges beside 0.2's ``first``/``last``; the cut table compact)
- ``ids``       the NewType ids that cross modules: NodeId, PlanVersion, SeqKey
- ``planner``   make_plan, the one planner (layers, then chunks), and predictions from a plan
- ``synthetic`` analytic profiles for tests and benchmarks
"""
