"""The device profile a benchmark's planner prices: this model's shipped profile, scaled to the decode step
measured in the same run (as the daemon's profiler would find this device), so its choice is judged against
figures taken on the same CPU."""

from __future__ import annotations

import dataclasses


def measured_profile(model_path: str, step_s: float, context: int, names: tuple[str, ...] = ("a", "b")):
    """One profile per name: the shipped profile of the model at ``model_path`` (any numeric mode; by layer
    count when none names it), its speed scaled so a decode step at ``context`` takes ``step_s``; None when no
    shipped profile has this model's layer count."""
    from decoding.loader import open_model
    from meshd.mesh.home_plan import shipped_profiles
    from partition.profile import DeviceProfile
    from partition.scaling import scale

    layers = open_model(model_path).config.num_layers
    shipped = [DeviceProfile.from_dict(d) for d in shipped_profiles()]
    base = next((p for p in shipped if p.num_layers == layers and p.model.identity.split("@")[0] in model_path), None)
    base = base or next((p for p in shipped if p.num_layers == layers), None)
    if base is None:
        return None
    dev = scale(base, float(base.decode_step(context)) / step_s)
    return [dataclasses.replace(dev, device_id=n, memory_budget_bytes=24 << 30) for n in names]


#: how the planner prices loopback between two pinned stage processes: an exchange here costs the planner's
#: per-exchange overhead and next to no round trip (bench RESULTS, issue #50)
LOOPBACK = "10gbit,0.01ms"


def priced_link(spec: str):
    """The LinkModel the planner prices for ``spec`` ("loopback", or BANDWIDTH[,RTT])."""
    from partition.link import parse_link

    return parse_link(LOOPBACK if spec == "loopback" else spec)
