"""Device profiles: schema v1 (partition.profile), interpolation (partition.interpolate), scaling to unmeasured
devices (partition.scaling)."""

import json

import numpy as np
import pytest

from partition import profile as pf
from partition.interpolate import bilinear, interp1, min_efficient_chunk, monotone_envelope
from partition.scaling import parse_profile_arg, parse_size, scale
from partition.synthetic import synthetic_profile


def test_profile_round_trips_through_json(tmp_path):
    p = synthetic_profile("dev-a", speed=1.7, memory_bytes=3 * 2**30)
    path = pf.save(p, tmp_path / "dev-a.json")
    assert pf.load(path) == p
    data = json.loads(path.read_text())
    assert data["schema"] == pf.SCHEMA and data["schema_version"] == 1


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d.pop("q"), "q"),
    (lambda d: d.update(schema_version=99), "schema_version"),
    (lambda d: d["layer_latency_s"].pop(), "layer_latency_s"),
    (lambda d: d["q"]["seconds"][0].append(1.0), "q.seconds"),
    (lambda d: d["decode_step_s"].__setitem__(0, -1.0), "decode_step_s"),
    (lambda d: d.update(dtype="float8"), "dtype"),
    (lambda d: d["q"].update(x=[4, 2, 1]), "q.x"),
    (lambda d: d.update(message_overhead_s=-0.001), "message_overhead_s"),
    (lambda d: d.update(message_overhead_s="fast"), "message_overhead_s"),
])
def test_invalid_profiles_are_rejected_naming_the_field(mutate, field):
    d = synthetic_profile().to_dict()
    mutate(d)
    with pytest.raises(pf.ProfileError, match=field.replace(".", r"\.")):
        pf.DeviceProfile.from_dict(d)


def test_the_per_chunk_message_cost_is_optional_and_scales_with_the_device():
    d = synthetic_profile().to_dict()
    d.pop("message_overhead_s", None)  # a profile written before the field existed
    old = pf.DeviceProfile.from_dict(d)
    assert old.message_overhead_s is None and old.chunk_overhead_s == pf.DEFAULT_MESSAGE_OVERHEAD_S
    assert scale(old, 2.0).message_overhead_s is None  # unmeasured stays unmeasured: the default applies
    measured = pf.DeviceProfile.from_dict(d | {"message_overhead_s": 0.004})
    assert measured.chunk_overhead_s == 0.004
    assert scale(measured, 2.0).chunk_overhead_s == pytest.approx(0.002)
    assert pf.DeviceProfile.from_dict(measured.to_dict()) == measured


def test_missing_profile_file_is_a_user_error(tmp_path):
    with pytest.raises(pf.ProfileError, match="no profile"):
        pf.load(tmp_path / "nope.json")


def test_bilinear_interpolation_is_exact_for_bilinear_costs():
    xs, ys = (1, 16, 64, 256), (0, 100, 400)
    f = lambda x, y: 0.5 + 0.1 * x + 0.02 * y + 0.003 * x * y  # noqa: E731
    grid = [[f(x, y) for y in ys] for x in xs]
    x = np.array([3, 20, 100, 255, 300])  # last one extrapolates
    y = np.array([7, 50, 399, 0, 500])
    assert bilinear(xs, ys, grid, x, y) == pytest.approx(f(x, y))


def test_piecewise_linear_interpolation_extrapolates_linearly():
    assert interp1([10, 20], [1.0, 2.0], 40) == pytest.approx(4.0)
    assert interp1([10, 20], [1.0, 2.0], 15) == pytest.approx(1.5)
    assert interp1([10, 20], [1.0, 2.0], -100) == 0.0  # never negative


def test_min_efficient_chunk_is_shortest_within_ten_percent_of_best_per_token():
    xs = [1, 16, 64, 256, 1024]
    per_chunk = [0.01, 0.020, 0.066, 0.25, 1.2]  # per token: 10, 1.25, 1.03, 0.98, 1.17 ms
    assert min_efficient_chunk(xs, per_chunk) == 64


def test_scaling_divides_latencies_and_sets_the_new_memory_budget():
    base = synthetic_profile("laptop")
    slow = scale(base, 0.5, 4 * 2**30, device_id="tablet")
    assert slow.device_id == "tablet"
    assert slow.full_model_time(1024) == pytest.approx(2 * base.full_model_time(1024))
    assert slow.q_layer(100, 300) == pytest.approx(2 * base.q_layer(100, 300))
    assert slow.decode_step(512) == pytest.approx(2 * base.decode_step(512))
    assert slow.memory_budget_bytes == pf.memory_budget(4 * 2**30, base.memory_headroom)
    assert slow.scaled_from["device_id"] == "laptop" and slow.scaled_from["speed_factor"] == 0.5
    # scaling a scaled profile composes
    assert scale(slow, 4.0).scaled_from["speed_factor"] == pytest.approx(2.0)
    # and survives the schema
    assert pf.DeviceProfile.from_dict(slow.to_dict()) == slow


def test_profile_argument_can_scale_a_measured_profile_on_the_fly(tmp_path):
    path = pf.save(synthetic_profile("laptop"), tmp_path / "laptop.json")
    p = parse_profile_arg(f"{path}@speed=0.25,mem=2GiB,id=phone")
    assert p.device_id == "phone" and p.memory_total_bytes == 2 * 2**30
    with pytest.raises(pf.ProfileError):
        parse_profile_arg(f"{path}@colour=blue")


@pytest.mark.parametrize("text, value", [("4GiB", 4 * 2**30), ("512MB", 512e6), ("1.5g", 1.5e9),
                                          ("1000", 1000)])
def test_sizes_are_read_with_units(text, value):
    assert parse_size(text) == int(value)


def test_monotone_envelope_trusts_the_faster_reading():
    t = np.array([[1.0, 5.0, 3.0], [2.0, 2.5, 4.0]])
    env = monotone_envelope(t)
    assert (np.diff(env, axis=0) >= 0).all() and (np.diff(env, axis=1) >= 0).all()
    assert (env <= t).all()
    assert env[0, 1] == 2.5  # disturbed reading replaced by a point with more work
