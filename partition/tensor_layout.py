"""A tensor-parallel group's price: its members' shares of the compute, and the exchanges of partial sums.

Why apart from the other layouts' prices: its cost is of another kind — not a layer range per device
but every layer on every member, and two exchanges of partial sums a layer whose cost is the link's
round trip — and the split's own rules (``partition.tensor_split``) decide whether a set of members
can form one at all. Pure.
"""

from __future__ import annotations

import itertools

from partition.ids import NodeId
from partition.layers import stage_memory_bytes
from partition.link import LinkModel
from partition.pricing import Group, Workload, batch_ratio, prefill_s
from partition.profile import DeviceProfile

#: bytes of one activation element between a tensor group's members (float32: the group adds exactly
#: what an in-process group adds; decoding.tensor_group)
TENSOR_ACTIVATION_BYTES = 4
#: what one exchange of partial sums costs beyond the link's round trip: the sockets, the encryption and
#: the hand-off into and out of the compute thread. Measured (bench/tensor_parallel.py: 108 us an exchange
#: between two pinned processes on loopback, AMD EPYC VM); a group that measures its own replaces it.
TENSOR_EXCHANGE_OVERHEAD_S = 100e-6


def tensor_fits(members: list[DeviceProfile], max_seq: int) -> bool:
    """Whether ``members`` hold the whole model between them, each its speed's share of every layer,
    and the model's heads split over that many (partition.tensor_split, blocks of one element: the
    file's own block widths are checked where the members load it)."""
    from partition.tensor_split import LayerShape, SplitError, split_layers

    m = members[0].model
    speeds = tensor_speeds(members, 1)
    try:
        split_layers(LayerShape(m.num_heads, m.num_kv_heads, m.head_dim, m.intermediate_size, m.vocab_size),
                     len(members), speeds)
    except SplitError:
        return False
    whole = [stage_memory_bytes(p, 0, p.num_layers, max_seq) for p in members]
    return all(need * s / sum(speeds) <= p.memory_budget_bytes for p, need, s in zip(members, whole, speeds))


def tensor_speeds(members: list[DeviceProfile], context: int) -> tuple[float, ...]:
    """Each member's relative speed: decode steps per second on its own (the split gives it that share)."""
    return tuple(1.0 / max(float(p.decode_step(context)), 1e-9) for p in members)


#: homes up to this size price a tensor group over every subset of members; larger ones over the k fastest
TENSOR_SUBSETS_UP_TO = 6


def fastest_first(members: list[DeviceProfile], work: Workload) -> list[DeviceProfile]:
    """A group's rank order: the fastest member first (it leads: it also samples)."""
    return sorted(members, key=lambda p: (float(p.decode_step(work.prompt_tokens)), p.device_id))


def tensor_candidates(ranked: list[DeviceProfile]) -> list[list[DeviceProfile]]:
    """The member sets a tensor group may be formed of (each fastest first)."""
    if len(ranked) <= TENSOR_SUBSETS_UP_TO:
        return [list(c) for k in range(2, len(ranked) + 1) for c in itertools.combinations(ranked, k)]
    return [ranked[:k] for k in range(2, len(ranked) + 1)]


def price_tensor_group(members: list[DeviceProfile], link: LinkModel, work: Workload,
                       exchange_overhead_s: float = TENSOR_EXCHANGE_OVERHEAD_S) -> Group:
    """A tensor-parallel group over ``members`` holding every layer: each computes its speed's share of
    every product (so all finish together), and every layer waits for two exchanges of partial sums, the
    head for one more. An exchange is priced as one of the link's round trips plus its bytes — on a
    LAN the round trips are the cost, which is why a group pays for big models on fast links only."""
    context = work.prompt_tokens + work.answer_tokens // 2
    speeds = tensor_speeds(members, context)
    total = sum(speeds)
    lead = members[0]
    L, hidden = lead.num_layers, lead.model.hidden_size
    syncs = 2 * L + 1

    def exchanges_s(rows: int) -> float:
        return syncs * (float(link.activation_transfer_s(rows, hidden, TENSOR_ACTIVATION_BYTES))
                        + exchange_overhead_s)

    steps = []
    for rows in range(1, work.requests + 1):
        compute = max(float(p.decode_step(context)) * (sp / total) * batch_ratio(p, rows, context)
                      for p, sp in zip(members, speeds))
        steps.append(compute + exchanges_s(rows))
    prefill = max(prefill_s([(p, 0, L)], link, work) * (sp / total) for p, sp in zip(members, speeds))
    prefill += exchanges_s(work.new_tokens)
    return Group(((NodeId(lead.device_id), 0, L),), prefill, tuple(steps),
                 tuple(NodeId(p.device_id) for p in members), tuple(round(sp / total, 6) for sp in speeds))
