"""The radix tree over token ids: its longest match equals a brute-force scan, through inserts and removals."""

from __future__ import annotations

import random

from decoding.prefix_index import PrefixIndex


def brute_longest(held: dict, ids: list[int]) -> tuple[int, set]:
    best, who = 0, set()
    for holder, toks in held.items():
        n = 0
        while n < min(len(toks), len(ids)) and toks[n] == ids[n]:
            n += 1
        if n > best:
            best, who = n, {holder}
        elif n == best and n > 0:
            who.add(holder)
    return best, who


def test_longest_match_equals_brute_force_through_random_inserts_and_removals():
    rng = random.Random(7)
    index, held = PrefixIndex(), {}
    stems = [[rng.randrange(4) for _ in range(rng.randrange(1, 30))] for _ in range(5)]
    for step in range(600):
        if held and rng.random() < 0.3:
            holder = rng.choice(sorted(held))
            index.remove(holder)
            del held[holder]
        else:
            holder = f"s{rng.randrange(40)}"
            ids = rng.choice(stems)[: rng.randrange(1, 31)] + [rng.randrange(4) for _ in range(rng.randrange(0, 12))]
            index.insert(holder, ids)
            held[holder] = ids
        for _ in range(5):
            query = rng.choice(stems)[: rng.randrange(0, 31)] + [rng.randrange(4) for _ in range(rng.randrange(0, 6))]
            n, holders = index.longest(query)
            want_n, want_holders = brute_longest(held, query)
            assert n == want_n, (step, query)
            if n:
                # every holder returned holds the match, and the deepest holders are among them
                assert all(held[h][:n] == query[:n] for h in holders)
                assert want_holders <= holders
    assert len(index) == len(held)


def test_a_prefix_is_held_by_every_sequence_through_it_and_goes_with_the_last_one():
    index = PrefixIndex()
    system = list(range(100))
    index.insert("a", system + [1, 2, 3])
    index.insert("b", system + [1, 9])
    assert index.longest(system + [1, 2, 7]) == (102, {"a"})
    assert index.longest(system + [5]) == (100, {"a", "b"})
    index.remove("a")
    assert index.longest(system + [1, 2, 7]) == (101, {"b"})
    index.remove("b")
    assert index.longest(system) == (0, set())


def test_reinserting_a_holder_replaces_what_it_held():
    index = PrefixIndex()
    index.insert("a", [1, 2, 3])
    index.insert("a", [1, 2])  # rolled back
    assert index.longest([1, 2, 3]) == (2, {"a"})
    assert index.tokens_of("a") == (1, 2)
