"""The control plane: how this device knows its home and agrees on a plan with it.

One object per job, wired by ``meshd.daemon``:

- ``local.LocalMember``: this device's own facts (node id, model, load state, profile);
- ``view.MeshView``: the members, their facts and addresses, the current plan — written
  by gossip, admission and the planner, read by everyone else (serving, sharing, status);
- ``gossip.Gossip``: heartbeats out, one handler per control message type in;
- ``planner.Planner``: the leader's re-plan, plan adoption, plan-version conflicts;
- ``admission.Admission``: mDNS adverts and sightings, pairing, connecting members;
- ``status.StatusDocument``: the ``GET /v1/mesh/status`` document.

Nothing here imports ``meshd.pipeline``, ``meshd.share`` or ``meshd.api``: the floors above
get this package's objects (and a callback or two), never the daemon.
"""
