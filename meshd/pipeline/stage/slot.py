"""One sequence a stage holds: its state, and what it knows about the positions it holds.

Its own module because three parts of the stage read a slot: the scheduler
creates, steps and frees it (:mod:`.scheduler`), the prefix cache shares what
its positions hold (:mod:`.prefix_cache`), and the worker runs a pass over it
(:mod:`.worker`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from decoding.selector import TokenSelector
from partition.ids import SeqKey

__all__ = ["SeqState", "SeqSlot"]


class SeqState(enum.Enum):
    PREFILLING = "prefilling"  # prompt chunks arriving
    DECODING = "decoding"  # one token per step
    VERIFYING = "verifying"  # speculative rounds: a token tree per step
    FINISHED = "finished"  # freed (its cache goes when the pass using it ends)


@dataclass(eq=False)
class SeqSlot:
    """One sequence held here: its state, when it was last active, and its last-stage sampling state."""

    seq: SeqKey
    touched: float
    state: SeqState = SeqState.PREFILLING
    stepped: float | None = None  # when it last ran a decode step or verify round here
    busy: bool = False  # in the compute thread's current pass
    selector: TokenSelector | None = None  # last stage: logits -> tokens, built on its first sample
    tokens: list[int] | None = field(default_factory=list)  # the token id at each position (None: unknown)
    unverified_from: int | None = None  # a verify round's nodes from here on await the next commit
    indexed: int = 0  # positions shared with other requests while this one runs (its computed prompt)
    dense_upto: int = 0  # exact stages: positions below this were computed in whole blocks, as a cold prompt's are
