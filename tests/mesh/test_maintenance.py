"""The control plane's tick measures its own lateness, so a busy device does not blame its peers."""

from meshd.mesh.maintenance import Maintenance


def make() -> Maintenance:
    # only the clock arithmetic is under test: the parts the tick drives are not touched
    return Maintenance(None, None, None, None, None, heartbeat_interval_s=0.4, replan_debounce_s=0.5,
                       clock=lambda: 0.0)


def test_a_tick_on_time_or_a_little_late_is_no_stall():
    m = make()
    assert m.step_s == 0.1
    assert m.stalled(0.0) == 0.0
    assert m.stalled(0.1) == 0.0
    assert m.stalled(0.25) == 0.0  # 50 ms late: scheduler jitter


def test_a_missed_step_counts_as_a_stall_of_its_lateness():
    m = make()
    m.stalled(0.0)
    assert abs(m.stalled(3.1) - 3.0) < 1e-9
    assert m.stalled(3.2) == 0.0  # on time again
