"""What a profile was measured with: the grids, repeats, threads and numeric mode.

A saved profile records its settings (``DeviceProfile.settings``) and is reused only
when a new measurement would use equal ones; ``PROFILER_VERSION`` is part of them, so
a change in how the profiler measures re-measures every saved profile. Plain data, so
the CLI that asks for a profile and the profiler that takes it (``meshd.model.profiler``)
agree on one shape.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from partition.profile import DEFAULT_HEADROOM

#: bumped when the measurement method changes, so saved profiles are re-measured
PROFILER_VERSION = 2


def _pow2_grid(max_seq: int) -> tuple[int, ...]:
    xs = [1, 4, 8] + [v for v in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192) if v < max_seq]
    return tuple(sorted(set(xs + [max_seq])))


@dataclass(frozen=True)
class ProfileSettings:
    """Everything that changes the measurement; a saved profile is re-used only if equal."""

    max_seq: int = 2048
    threads: int = 1
    dtype: str = "float32"
    repeats: int = 3
    layer_repeats: int = 2
    calib_seq_lens: tuple[int, ...] = ()
    q_x: tuple[int, ...] = ()
    q_y: tuple[int, ...] = ()
    decode_context: tuple[int, ...] = ()
    headroom: float = DEFAULT_HEADROOM
    memory_bytes: int | None = None  # override the device's total memory

    def resolved(self) -> "ProfileSettings":
        """Fill the grids from ``max_seq`` when they were left empty."""
        S = self.max_seq
        calib = self.calib_seq_lens or tuple(sorted({min(v, S) for v in (16, 128, 512, S)}))
        qx = self.q_x or _pow2_grid(S)
        qy = self.q_y or tuple(sorted({0, S // 8, S // 4, S // 2, 3 * S // 4, S}))
        dec = self.decode_context or tuple(sorted({0, S // 8, S // 4, S // 2, S}))
        return ProfileSettings(S, self.threads, self.dtype, self.repeats, self.layer_repeats,
                               tuple(calib), tuple(qx), tuple(qy), tuple(dec), self.headroom,
                               self.memory_bytes)

    def to_dict(self) -> dict:
        d = {"profiler_version": PROFILER_VERSION, **asdict(self.resolved())}
        for k, v in d.items():
            if isinstance(v, tuple):
                d[k] = list(v)
        return d
