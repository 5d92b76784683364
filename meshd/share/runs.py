"""Sets of piece indices as sorted half-open runs ``[[first, end), ...]``.

What a member holds is mostly a few long runs (a layer range is contiguous in
a GGUF file), so runs keep adverts and the on-disk record small whatever the
model's size.
"""

from __future__ import annotations

from collections.abc import Iterable


def to_runs(indices: Iterable[int]) -> list[list[int]]:
    """Sorted, merged, half-open runs covering exactly ``indices``."""
    out: list[list[int]] = []
    for i in sorted(set(indices)):
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return out


def from_runs(runs: Iterable[Iterable[int]], limit: int | None = None) -> set[int]:
    """The indices in ``runs``; raises ValueError on a malformed run or one past ``limit``."""
    out: set[int] = set()
    for run in runs:
        pair = list(run)
        if len(pair) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in pair):
            raise ValueError(f"a run is [first, end) of two integers, got {run!r}")
        first, end = pair
        if not 0 <= first <= end or (limit is not None and end > limit):
            raise ValueError(f"run [{first}, {end}) outside [0, {limit})")
        out.update(range(first, end))
    return out
