"""One typed record per engine knob: how a user sets it, its type, its default as a function of the
other settings, its valid range, what it limits, whether the simulator models it and which causes
name it. Each engine declares its own (``gputrace/engines/<engine>``); every flag table of the
package (findings' changes, the what-if, the advice, the demo, the report, the knob reference) is a
lookup into them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

# The settings a default reads (gputrace's setting names: EngineSettings' fields and pp_size): a
# Mapping, so the engines need not import the run's tables.
Settings = Mapping[str, object]


@dataclass(frozen=True, slots=True)
class Knob:
    """One setting of one engine that a finding, the what-if or the advice can change."""

    name: str  # gputrace's setting name (EngineSettings, the simulator, Change.knob)
    flag: str  # how a user sets it on this engine (a flag, an environment variable)
    type: type  # int, float or str (a layer split)
    limits: str  # what it limits, in a phrase
    default_text: str  # the default as the engine's documentation or source states it
    # the default from the other settings (None: the engine derives it from what gputrace does not
    # read, the GPU's memory say); gives None where a setting it needs is not known
    default: Callable[[Settings], int | None] | None = None
    low: float | None = None  # the valid range, both ends included (None: unbounded)
    high: float | None = None
    simulated: bool = False  # the simulator (and so the what-if and the advice) models it
    setting: str | None = None  # the engine's own name for it, where it is not ``name``
    param: str | None = None  # the simulator's parameter, where it is not ``name``
    # how the advice writes a value in gputrace's unit where the flag takes another (vLLM's KV
    # pool is a share of memory, the advice's value tokens)
    value_flag: str | None = None
    causes: tuple[str, ...] = ()  # the findings' causes (``Cause`` values) that name it
    # the simulator's parameters it sets beside its own, to the same value (vLLM's one step budget
    # is both the chunk and the turn's budget)
    sets_too: tuple[str, ...] = ()
    # it changes how the engine serves (False: only what its log shows)
    serving: bool = True
    # a deployment setting a user can name in ``--set`` (an environment variable such as the layer
    # split is changed by the what-if through its simulator parameter, under that name)
    settable: bool = True

    @property
    def own_name(self) -> str:
        """The engine's name for it (vLLM's ``max_num_seqs``)."""
        return self.setting or self.name

    @property
    def sim_param(self) -> str | None:
        """The simulator's parameter that models it; None where the simulator does not."""
        return (self.param or self.name) if self.simulated else None

    def default_for(self, settings: Settings) -> int | None:
        """The engine's default under ``settings``; None where it does not follow from them."""
        return None if self.default is None else self.default(settings)

    def in_range(self, value: float) -> bool:
        return (self.low is None or value >= self.low) and (self.high is None or value <= self.high)

    def range_text(self) -> str:
        def end(x: float | None) -> str:
            return "" if x is None else f"{x:g}"

        if self.low is None and self.high is None:
            return "any"
        if self.high is None:
            return f">= {end(self.low)}"
        if self.low is None:
            return f"<= {end(self.high)}"
        return f"{end(self.low)} to {end(self.high)}"


INTERLEAVING_CHUNK_MIN_TOKENS = 256


def interleaving_chunk(budget_tokens: int, slots: int) -> int:
    """A prefill chunk that lets a long prompt take turns with decodes: the power of two at most
    budget / slots (at least 256 tokens). A long prompt's chunks then go round the micro-batch
    slots in about the time one budget-sized chunk held every stage, so each micro-batch's decode
    waits one small chunk's step, not a whole prompt's (the finding of a prefill stall names it,
    and the simulator's ground truth runs it as the fix)."""
    per_slot = max(budget_tokens // max(slots, 1), 1)
    return max(1 << (per_slot.bit_length() - 1), INTERLEAVING_CHUNK_MIN_TOKENS)
