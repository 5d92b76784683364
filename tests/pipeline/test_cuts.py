"""Where the coordinator cuts a prompt: the plan's table, equal chunks past it, block-aligned when packed."""

from decoding.batch import EXACT_BLOCK
from meshd.pipeline.coordinator.cuts import UNCUT_PROMPT, aligned_cuts, decoded_runs, default_cuts, prompt_cuts
from partition.cuttable import CutTable


def table_up_to(max_seq: int) -> CutTable:
    """A table that cuts every prompt once, in the middle."""
    cuts = tuple((y // 2,) if y >= 2 else () for y in range(max_seq + 1))
    return CutTable(max_seq, 2, 1, cuts, tuple(0.0 for _ in range(max_seq + 1)))


def test_default_cuts_give_about_two_chunks_per_stage_and_none_too_short():
    assert default_cuts(1024, 2) == [256, 512, 768]
    assert default_cuts(40, 2) == []
    assert default_cuts(100, 2) == []  # short prompts go whole: cutting costs more than it overlaps
    assert default_cuts(500, 1) == []


def test_cuts_in_a_packed_home_move_to_block_boundaries():
    assert aligned_cuts([100, 200, 300], 400, 64) == [128, 192, 320]
    assert aligned_cuts([10, 20, 390], 400, 64) == [384]  # none may meet an end or repeat
    assert aligned_cuts([], 50, 64) == []


def test_a_prompt_is_cut_by_the_plans_table_where_it_reaches_and_equally_past_it():
    table = table_up_to(600)
    assert prompt_cuts(500, 2, table, packed=False) == [250]
    assert prompt_cuts(1024, 2, table, packed=False) == default_cuts(1024, 2)
    assert prompt_cuts(1024, 2, None, packed=False) == default_cuts(1024, 2)


def test_short_prompts_and_one_stage_homes_go_whole_and_packed_cuts_sit_on_blocks():
    table = table_up_to(600)
    assert prompt_cuts(UNCUT_PROMPT - 1, 2, table, packed=False) == []
    assert prompt_cuts(500, 1, table, packed=False) == []
    assert all(c % EXACT_BLOCK == 0 for c in prompt_cuts(500, 2, table, packed=True))
    assert prompt_cuts(500, 2, table, packed=True) == aligned_cuts([250], 500, EXACT_BLOCK)


def test_tokens_decoded_one_at_a_time_are_prefilled_again_in_chunks_holding_no_whole_block():
    """A replay re-prefills what was decoded: no chunk may take a whole block's dense path (brute force)."""
    b = 8
    for start in range(0, 3 * b):
        for end in range(start, start + 4 * b):
            runs = decoded_runs(start, end, b)
            assert [p for r in runs for p in range(*r)] == list(range(start, end))  # in order, each once
            for lo, hi in runs:
                assert hi - lo <= b
                assert not any(lo <= k * b and (k + 1) * b <= hi for k in range(hi // b + 1)), (start, end, lo, hi)
            assert len(runs) <= (end - start) // b + 2  # no needless messages
