"""The one table of which decoding modes combine (meshd.engine.modes), read as a specification."""

from __future__ import annotations

import itertools

import pytest

from meshd.engine.errors import BadEngineRequest
from meshd.engine.modes import REQUIRED, RULES, Ask, Mode, ModesClash, resolve

OFF, AUTO, ON = Ask.OFF, Ask.AUTO, Ask.ON
S, T, SPEC, O, C, E = Mode.SHAPED, Mode.TOOLS, Mode.SPECULATIVE, Mode.OUTLINE, Mode.CLOUD, Mode.EXITS


def runs(**asks: Ask) -> set[Mode]:
    return set(resolve({Mode[name.upper()]: ask for name, ask in asks.items()}).runs)


def test_modes_that_do_not_clash_all_run():
    assert runs(outline=ON, speculative=AUTO) == {O, SPEC}  # an outline's points speculate
    assert runs(tools=ON, speculative=ON, exits=OFF) == {T, SPEC}  # calls in free text may be drafted
    assert runs(shaped=ON, tools=ON) == {S, T}  # a tool grammar is itself a grammar
    assert runs(shaped=ON, tools=ON, speculative=AUTO) == {S, T, SPEC}  # drafts are verified under the grammar
    assert runs(shaped=ON, speculative=ON) == {S, SPEC}
    assert runs(tools=ON, exits=ON) == {T, E} and runs(tools=ON, cloud=AUTO) == {T, C}
    assert runs() == set() and runs(speculative=OFF, outline=OFF) == set()


@pytest.mark.parametrize("loser", [E, C, O])
def test_a_grammar_or_penalties_shape_every_token_so_what_cannot_follow_them_steps_aside(loser):
    assert set(resolve({S: ON, loser: AUTO}).runs) == {S}
    assert resolve({S: ON, loser: AUTO}).gave_way == {loser: S}
    with pytest.raises(ModesClash, match="structured output or repetition penalties"):
        resolve({S: ON, loser: ON})


def test_offered_tools_keep_an_outline_away_and_refuse_one_asked_for():
    assert runs(tools=ON, outline=AUTO) == {T}
    with pytest.raises(ModesClash, match='tools cannot be combined with outline decoding "on"'):
        resolve({T: ON, O: ON})


@pytest.mark.parametrize("other", [SPEC, O])
def test_early_exits_win_between_defaults_and_lose_to_an_explicit_ask(other):
    assert runs(exits=AUTO, **{other.name.lower(): AUTO}) == {E}
    assert runs(exits=ON, **{other.name.lower(): AUTO}) == {E}
    assert runs(exits=AUTO, **{other.name.lower(): ON}) == {other}
    with pytest.raises(ModesClash, match="send exit_threshold 0 or"):
        resolve({E: ON, other: ON})


def test_a_paired_verifier_wins_between_defaults_and_early_exits_asked_for_win_over_it():
    assert runs(cloud=AUTO, exits=AUTO) == {C} and runs(cloud=ON, exits=AUTO) == {C}
    assert runs(cloud=AUTO, exits=ON) == {E}
    with pytest.raises(ModesClash, match="a cloud budget cannot be combined with early exits"):
        resolve({C: ON, E: ON})


@pytest.mark.parametrize("other", [SPEC, O])
@pytest.mark.parametrize("cloud", [AUTO, ON])
@pytest.mark.parametrize("ask", [AUTO, ON])
def test_a_verified_answer_is_the_big_models_own_whatever_else_was_asked(other, cloud, ask):
    assert resolve({C: cloud, other: ask}).runs == {C}  # never an error: it drafts and checks its own way


def test_a_mode_that_gave_way_makes_nothing_else_give_way():
    """An outline "on" turns a default early exit off; the speculation that exit would have turned off runs."""
    r = resolve({O: ON, E: AUTO, SPEC: AUTO})
    assert r.runs == {O, SPEC} and r.gave_way == {E: O}
    assert runs(cloud=AUTO, exits=AUTO, speculative=AUTO) == {C}


def test_every_explicit_clash_is_refused_whatever_else_runs_and_is_the_apis_400():
    with pytest.raises(ModesClash) as err:
        resolve({S: ON, C: AUTO, E: AUTO, O: ON})
    assert isinstance(err.value, BadEngineRequest) and err.value.http_status == 400
    assert set(err.value.modes) == {S, O} and 'send outline "auto" or "off"' in str(err.value)


def test_the_table_names_only_pairs_and_never_lets_a_mode_give_way_to_itself():
    assert all(len(pair) == 2 and rule.first in pair for pair, rule in RULES.items())


def test_a_grammar_penalties_and_tools_are_part_of_what_was_asked_never_a_default():
    assert REQUIRED == {S, T}
    assert resolve({S: AUTO, O: AUTO}).runs == {S}
    with pytest.raises(ModesClash):
        resolve({S: AUTO, O: ON})


_EVERY = [dict(zip(Mode, combo)) for combo in itertools.product(
    *[(OFF, ON) if m in REQUIRED else tuple(Ask) for m in Mode])]


@pytest.mark.parametrize("asks", _EVERY)
def test_every_request_either_resolves_or_is_refused_and_what_runs_never_clashes(asks):
    """All 324 requests: no cycle, and no two running modes the table says cannot run together."""
    try:
        r = resolve(asks)
    except ModesClash as exc:
        a, b = exc.modes
        assert asks[a] is ON and asks[b] is ON and frozenset(exc.modes) in RULES
        return
    assert all(asks[m] is not OFF for m in r.runs)
    assert not any(frozenset(pair) in RULES for pair in itertools.combinations(r.runs, 2))
    assert all(asks[m] is not OFF and m not in r.runs and w in r.runs for m, w in r.gave_way.items())
