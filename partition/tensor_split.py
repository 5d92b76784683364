"""How a tensor-parallel group divides a layer range: which query and KV heads, which MLP columns and which
vocabulary rows each member holds.

Why a planner of its own: the cut points are not free. A member's query heads must be a whole run of the
output projection's input blocks (a K-quant super-block is 256 inputs wide, two heads of 128), the MLP's
split must fall on the down projection's block boundaries, and grouped-query attention ties query heads to
their KV head: a member either owns whole KV groups or lies inside one group (then its KV head is computed
by every member of that group: replicated, as a model with fewer KV heads than members requires). Within
those rules the split is balanced by the members' speeds, so an uneven home gives the faster device more.

Two ways to hold the attention (``ATTENTIONS``): ``split`` by heads as above (two exchanges of partial sums
a layer), or ``whole`` — every member computes every head and only the MLP and the LM head are split (one
exchange a layer). Attention is ~10 % of a Qwen2.5 layer's weights, so ``whole`` costs each member that
much more reading and saves half the exchanges: the trade a link with a real round trip wants.

Pure: numbers in, ranges out (half-open), checked against brute force in the tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

Range = tuple[int, int]  # half-open [start, stop)


#: how a group holds the attention: split by heads (two exchanges a layer) or whole on every member (one)
ATTENTIONS = ("split", "whole")


class SplitError(ValueError):
    """No split of this shape over this many members meets the block and KV-group rules."""


@dataclass(frozen=True)
class LayerShape:
    """The widths a split needs (``decoding.config.ModelConfig`` has them; block widths from the weights)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    o_block: int = 1  # input block width of the output projection (32, 256, or 1 for unquantised)
    down_block: int = 1  # input block width of the down projection


@dataclass(frozen=True)
class MemberSlice:
    """What one member of a group holds of every layer in its range, and of the LM head."""

    rank: int
    heads: Range  # query heads
    kv_heads: Range  # the KV heads its query heads read (shared with a neighbour when replicated)
    inter: Range  # columns of gate/up (rows) and down (inputs)
    vocab: Range  # LM head rows

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]


@dataclass(frozen=True)
class TensorSplit:
    shape: LayerShape
    members: tuple[MemberSlice, ...]
    attention: str = "split"  # one of ATTENTIONS

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def replicated_kv(self) -> bool:
        """Whether some KV head is computed by more than one member."""
        owned = [m.kv_heads for m in self.members]
        return any(a[1] > b[0] for a, b in zip(owned, owned[1:]))


def _balanced(units: int, weights: tuple[float, ...], ok) -> tuple[int, ...] | None:
    """Boundaries 0 = b0 < ... < bn = units (each segment ``ok(a, b)``) minimising the slowest member's
    share/weight; ties go to the earliest boundaries. None: no valid split."""
    n = len(weights)

    @lru_cache(maxsize=None)
    def best(i: int, start: int) -> tuple[float, tuple[int, ...]] | None:
        if i == n - 1:
            return ((units - start) / weights[i], (units,)) if ok(start, units) else None
        found = None
        for stop in range(start + 1, units - (n - 1 - i) + 1):
            if not ok(start, stop):
                continue
            rest = best(i + 1, stop)
            if rest is None:
                continue
            cost = max((stop - start) / weights[i], rest[0])
            if found is None or cost < found[0] - 1e-12:
                found = (cost, (stop, *rest[1]))
        return found

    got = best(0, 0)
    return None if got is None else (0, *got[1])


def split_layers(shape: LayerShape, n: int, speeds: tuple[float, ...] | None = None,
                 attention: str = "split") -> TensorSplit:
    """The balanced split of ``shape`` over ``n`` members (``speeds``: their relative compute, default equal);
    ``attention`` "whole": every member holds every head (the MLP and the head still split)."""
    if n < 1:
        raise SplitError("a group has at least one member")
    if attention not in ATTENTIONS:
        raise SplitError(f"attention is held {' or '.join(ATTENTIONS)}, not {attention!r}")
    speeds = tuple(float(s) for s in (speeds or (1.0,) * n))
    if len(speeds) != n or min(speeds) <= 0:
        raise SplitError(f"{n} members need {n} positive speeds, got {speeds}")
    nh, nkv, hd = shape.num_heads, shape.num_kv_heads, shape.head_dim
    if nh % nkv:
        raise SplitError(f"{nh} query heads do not form groups over {nkv} KV heads")
    group = nh // nkv
    if attention == "whole":
        heads = [(0, nh)] * n
    else:
        heads = _head_ranges(nh, nkv, hd, shape.o_block, speeds)
    if shape.intermediate % shape.down_block or shape.intermediate // shape.down_block < n:
        raise SplitError(f"{shape.intermediate} MLP columns in blocks of {shape.down_block} do not split over {n}")
    inter_units = shape.intermediate // shape.down_block
    ib = _proportional(inter_units, speeds)
    if min(b - a for a, b in zip(ib, ib[1:])) < 1:
        raise SplitError(f"a member's share of {inter_units} MLP blocks rounds to none")
    inter = [(a * shape.down_block, b * shape.down_block) for a, b in zip(ib, ib[1:])]
    vb = _proportional(shape.vocab, speeds)
    members = tuple(
        MemberSlice(r, h, (h[0] // group, -(-h[1] // group)), inter[r], (vb[r], vb[r + 1]))
        for r, h in enumerate(heads))
    return TensorSplit(shape, members, attention)


def _head_ranges(nh: int, nkv: int, hd: int, o_block: int, speeds: tuple[float, ...]) -> list[Range]:
    """Each member's query heads, balanced by ``speeds``: whole o-blocks, whole KV groups or inside one."""
    group = nh // nkv
    # the smallest run of heads whose o-projection columns are whole blocks
    unit = o_block // math.gcd(o_block, hd)
    if nh % unit:
        raise SplitError(f"{nh} heads of {hd} are not whole {o_block}-wide blocks")

    def heads_ok(a: int, b: int) -> bool:  # in units
        a, b = a * unit, b * unit
        return (a % group == 0 and b % group == 0) or a // group == (b - 1) // group

    bounds = _balanced(nh // unit, speeds, heads_ok)
    if bounds is None:
        raise SplitError(f"{nh} heads ({nkv} KV heads, {hd} wide, {o_block}-wide blocks) do not split over "
                         f"{len(speeds)}")
    return [(a * unit, b * unit) for a, b in zip(bounds, bounds[1:])]


def _proportional(total: int, speeds: tuple[float, ...]) -> list[int]:
    """Boundaries splitting ``total`` units in proportion to ``speeds``; a unit left over by rounding goes
    to the later member (the first member leads the group: it also sends the commands and samples)."""
    s = sum(speeds)
    acc, out = 0.0, [0]
    for w in speeds[:-1]:
        acc += w
        out.append(math.ceil(total * acc / s - 0.5))
    out.append(total)
    return out
