"""What a request asks of its generation, and what an engine can honour: one value each.

The API's two dialects (:mod:`meshd.api.openai_schema`, :mod:`meshd.api.ollama_schema`)
each end in one :class:`RequestOptions`, and the engine request carries it whole
(:attr:`meshd.engine.base.GenerationRequest.options`): a new option is one field here,
read where it is used, instead of a field copied from one dataclass to the next on the
way down. :class:`Capabilities` is the engine's side of the same contract: one value
the API checks a request against (and :class:`~meshd.engine.draining.DrainingEngine`
passes on whole), so a capability is not a flag forwarded one by one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from decoding.sampling import SamplingSpec
from decoding.speculative.params import SpeculativeParams


@dataclass(frozen=True)
class RequestOptions:
    """What a request asks besides its prompt, as the API parsed it.

    ``sampling`` is the one :class:`decoding.sampling.SamplingSpec` (the draw, penalties,
    a grammar) that reaches the sampler unchanged; its default is greedy (the API maps
    OpenAI's default temperature of 1.0 itself). ``max_tokens`` is what the client asked
    (None: as many as the context allows); the engine request's own ``max_tokens`` is the
    budget resolved against the context. ``stream``, ``include_usage`` and
    ``constraint_param`` only shape the API's reply and errors; the rest is meshd's
    decoding modes, whose combinations :mod:`meshd.engine.modes` decides.
    """

    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    constraint_param: str | None = None  # the request field that asked for sampling.constraint, for errors
    speculative: SpeculativeParams = field(default_factory=SpeculativeParams)
    outline: str = "auto"  # outline-based parallel decoding: "auto" | "on" | "off"
    tools_offered: bool = False  # the prompt offers tools: calls may be parsed from free text
    cloud: str | float = "auto"  # a paired cloud verifier: "auto" | "off" | a budget in [0, 1]
    exit_threshold: float | None = None  # early exits' top-2 margin (None: the daemon's; 0: off)


@dataclass(frozen=True)
class Capabilities:
    """What an engine honours beyond plain sampling.

    The API answers 400 to a request that needs a capability its engine lacks, instead
    of serving it silently without.
    """

    constraints: bool = False  # RequestOptions.sampling.constraint (structured output, tool grammars)
    penalties: bool = False  # RequestOptions.sampling.penalties
    outline: bool = False  # RequestOptions.outline "on"
    cloud: bool = False  # RequestOptions.cloud as a budget
    exits: bool = False  # RequestOptions.exit_threshold
