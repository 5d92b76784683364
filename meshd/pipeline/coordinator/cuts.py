"""Where a prompt is cut into chunks for the intra-sequence pipeline.

The leader's plan ships a cut table (``partition.cuttable.CutTable``) computed
from the members' profiles; until one exists, or past its longest prompt, a
prompt is cut into equal chunks. A packed stage computes whole position blocks
together (``decoding.batch``), so there every cut moves to a block boundary and
the pipeline's answer stays bit for bit one device's.
"""

from __future__ import annotations

from decoding.batch import EXACT_BLOCK
from partition.cuttable import CutTable

MIN_CHUNK = 32  # shorter sub-sequences cost more in per-message overhead than they win in overlap
UNCUT_PROMPT = 128  # below this a prompt goes as one chunk: cutting costs more hops than it overlaps

__all__ = ["MIN_CHUNK", "UNCUT_PROMPT", "aligned_cuts", "decoded_runs", "default_cuts", "prompt_cuts"]


def default_cuts(prompt_len: int, num_stages: int) -> list[int]:
    """Equal sub-sequences (about two per stage, none under MIN_CHUNK) until a planned table exists."""
    if num_stages <= 1 or prompt_len < UNCUT_PROMPT:
        return []
    k = max(1, min(2 * num_stages, prompt_len // MIN_CHUNK))
    return [round(prompt_len * i / k) for i in range(1, k)]


def aligned_cuts(cuts: list[int], prompt_len: int, block: int) -> list[int]:
    """``cuts`` moved to the nearest multiple of ``block`` (dropping those that meet or fall off an end).

    A packed stage computes whole position blocks together and any other row alone
    (``decoding.batch``): a prompt cut only at block boundaries is then computed
    exactly as one device computes it uncut, bit for bit.
    """
    out: list[int] = []
    for c in cuts:
        a = int(round(c / block)) * block
        if 0 < a < prompt_len and (not out or a > out[-1]):
            out.append(a)
    return out


def prompt_cuts(prompt_len: int, num_stages: int, table: CutTable | None, packed: bool) -> list[int]:
    """The cut points for one prompt: the plan's table where it reaches, equal chunks past it."""
    if prompt_len < UNCUT_PROMPT or num_stages <= 1:
        return []
    if table is not None and prompt_len <= table.max_seq:
        cuts = list(table.lookup(prompt_len))
    else:
        cuts = default_cuts(prompt_len, num_stages)
    return aligned_cuts(cuts, prompt_len, EXACT_BLOCK) if packed else cuts


def decoded_runs(start: int, end: int, block: int = EXACT_BLOCK) -> list[tuple[int, int]]:
    """Positions ``[start, end)`` that were decoded one at a time, as chunks to prefill them again (a replay).

    A packed stage computes a chunk's whole blocks together and every other row alone
    (``decoding.batch``). One device computed these positions alone (decode steps), so
    no chunk may hold a whole block: each ends one past a block boundary, and holds at
    most ``block`` rows, which then all go the row-at-a-time way a decode step went.
    """
    out, a = [], start
    while a < end:
        b = min(end, ((a - 1) // block + 1) * block + 1)  # the first position past a that is 1 mod block
        out.append((a, b))
        a = b
    return out
