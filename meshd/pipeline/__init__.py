"""The cross-device pipeline: stages served over the transport, driven by a coordinator.

    request ─► coordinator ─► stage 0 ─► stage 1 ─► … ─► last stage ─┐
                   ▲                                                │
                   └──────────── TokenResult (token ids only) ──────┘

Activations travel stage to stage, never through the coordinator; the last
stage samples and returns only token ids.
"""
