"""A tensor-parallel group's price: its members' shares of the compute, and the exchanges of partial sums.

Why apart from the other layouts' prices: its cost is of another kind — not a layer range per device
but every layer on every member, and one or two exchanges of partial sums a layer whose cost is the
link's round trip — and the split's own rules (``partition.tensor_split``) decide whether a set of
members can form one at all. Pure.
"""

from __future__ import annotations

import itertools

from partition.ids import NodeId
from partition.layers import stage_memory_bytes
from partition.link import LinkModel
from partition.pricing import Group, Workload, batch_ratio, prefill_s
from partition.profile import DeviceProfile
from partition.tensor_split import ATTENTIONS, LayerShape, SplitError, split_layers

#: bytes of one activation element between a tensor group's members (float32: the group adds exactly
#: what an in-process group adds; decoding.tensor_group)
TENSOR_ACTIVATION_BYTES = 4
#: what one exchange of partial sums costs beyond the link's round trip: the sockets, the encryption and
#: the members' skew. Measured (bench/tensor_parallel.py, two pinned processes on loopback, AMD EPYC VM,
#: the decode kernel exchanging the sums itself): 30 us (SmolLM2-135M), 50 us (Qwen2.5-Coder-0.5B) and
#: 74 us (1.5B) each inside a decode step, the token's coordination spread over them; 0.1-0.14 ms when
#: every exchange went through Python. A group that measures its own replaces it.
TENSOR_EXCHANGE_OVERHEAD_S = 50e-6


def tensor_fits(members: list[DeviceProfile], max_seq: int, attention: str = "split") -> bool:
    """Whether ``members`` hold the whole model between them, each its speed's share of every layer
    (and all of the attention when it is held ``whole``), and the model's heads split over that many
    (partition.tensor_split, blocks of one element: the file's own block widths are checked where the
    members load it)."""
    m = members[0].model
    speeds = tensor_speeds(members, 1)
    try:
        split_layers(LayerShape(m.num_heads, m.num_kv_heads, m.head_dim, m.intermediate_size, m.vocab_size),
                     len(members), speeds, attention)
    except SplitError:
        return False
    whole = [stage_memory_bytes(p, 0, p.num_layers, max_seq) for p in members]
    return all(need * member_share(p, s / sum(speeds), attention) <= p.memory_budget_bytes
               for p, need, s in zip(members, whole, speeds))


#: the attention's part of a decode step over its part of the weights: besides its four products it
#: rotates, writes the cache and attends, row by row. Measured (AVX2 kernels, one core, Qwen2.5-Coder-1.5B,
#: 64-token context): a member's decode step with no partner to wait for takes 33.3 ms holding half the
#: heads and 37.0 ms holding all of them (one device 65.2 ms), so the attention is 0.115 of a step for 0.087
#: of the weights. A profile that measures its own attention would replace it.
ATTENTION_TIME_PER_WEIGHT = 1.3


def attention_share(p: DeviceProfile) -> float:
    """The attention's part of a decode step: its part of the weights (q, k, v and o of every layer against
    every layer and the LM head; 0.087 for Qwen2.5-1.5B) times what a row of it costs beyond its weights
    (0.113 of a step for that model)."""
    m = p.model
    attention = m.hidden_size * m.head_dim * (2 * m.num_heads + 2 * m.num_kv_heads)
    layer = attention + 3 * m.hidden_size * m.intermediate_size
    weights = p.num_layers * attention / (p.num_layers * layer + m.vocab_size * m.hidden_size)
    return min(0.9, weights * ATTENTION_TIME_PER_WEIGHT)


def member_share(p: DeviceProfile, share: float, attention: str) -> float:
    """What a member with ``share`` of the split products computes (and, near enough, holds) of the whole
    model."""
    if attention == "whole":
        a = attention_share(p)
        return a + (1.0 - a) * share
    return share


def exchanges_per_token(layers: int, attention: str) -> int:
    """A group's exchanges of partial sums a decode step: the attention's and the MLP's every layer (the
    MLP's only, when the attention is held whole), and the head's gather."""
    return (layers if attention == "whole" else 2 * layers) + 1


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
                       exchange_overhead_s: float = TENSOR_EXCHANGE_OVERHEAD_S,
                       attentions: tuple[str, ...] = ATTENTIONS, max_seq: int | None = None) -> Group | None:
    """A tensor-parallel group over ``members`` holding every layer, in the cheaper of ``attentions`` that
    fits (``max_seq``: the KV cache it must hold; None: not checked): None when none does."""
    priced = [_price_tensor_group(members, link, work, exchange_overhead_s, a) for a in attentions
              if max_seq is None or tensor_fits(members, max_seq, a)]
    return min(priced, key=lambda g: (g.latency_s(work.requests, work.answer_tokens), g.tensor_attention),
               default=None)


def _price_tensor_group(members: list[DeviceProfile], link: LinkModel, work: Workload, exchange_overhead_s: float,
                        attention: str) -> Group:
    """Each member computes its speed's share of every split product (so all finish together), and every
    layer waits for two exchanges of partial sums (one when the attention is held whole, which every
    member then computes), the head for one more. An exchange is priced as one of the link's round
    trips plus its bytes — on a LAN the round trips are the cost, which is why a group pays for big
    models on fast links only, and why a link with a real round trip prefers the attention whole."""
    context = work.prompt_tokens + work.answer_tokens // 2
    speeds = tensor_speeds(members, context)
    total = sum(speeds)
    lead = members[0]
    L, hidden = lead.num_layers, lead.model.hidden_size
    syncs = exchanges_per_token(L, attention)

    def exchanges_s(rows: int) -> float:
        return syncs * (float(link.activation_transfer_s(rows, hidden, TENSOR_ACTIVATION_BYTES))
                        + exchange_overhead_s)

    steps = []
    for rows in range(1, work.requests + 1):
        compute = max(float(p.decode_step(context)) * member_share(p, sp / total, attention)
                      * batch_ratio(p, rows, context) for p, sp in zip(members, speeds))
        steps.append(compute + exchanges_s(rows))
    prefill = max(prefill_s([(p, 0, L)], link, work) * member_share(p, sp / total, attention)
                  for p, sp in zip(members, speeds))
    prefill += exchanges_s(work.new_tokens)
    return Group(((NodeId(lead.device_id), 0, L),), prefill, tuple(steps),
                 tuple(NodeId(p.device_id) for p in members), tuple(round(sp / total, 6) for sp in speeds),
                 attention)
