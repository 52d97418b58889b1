"""The words the packages share, typed once: the engine's settings, a diagnosed cause, the change
of a setting a finding (or the advice) names, a problem of the capture. Plain data, no I/O;
every layer may import it.

- ``EngineSettings`` (defined beside the run's tables, re-exported here): the engine's
  configuration as its log gave it, with ``slot_count`` / ``slots_at`` (SGLang's micro-batch
  slots, pp_size + pp_async_batch_depth), ``admission_limit`` and ``microbatch_cap_at``.
- ``Cause``: what a finding diagnosed; a ``str`` enum, so findings.json holds the same strings.
- ``Change``: a setting and its value (``knob`` the setting's name, ``flag`` how a user sets it).
- ``CaptureProblem``: what the collector records in ``meta.extra["collector"]`` when a source
  delivered nothing for a while (and what /v1/status and /healthz list while it lasts).
- ``LiveStatus``: the collector's /v1/status document, which `gputrace watch` renders.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from gputrace.engines import ENGINE_WORDS
from gputrace.json_types import JsonObject, JsonReadObject, JsonReadValue
from gputrace.run_tables import EngineSettings

__all__ = ["FLAG_KNOBS", "LOAD_KNOBS", "CaptureProblem", "Cause", "Change", "EngineSettings", "LiveStatus"]


class Cause(StrEnum):
    """What keeps the stages idle (or the measurement unreliable) in a phase."""

    ADMISSION_BOUND = "admission_bound"
    MICROBATCH_CAP = "microbatch_cap"
    PIPELINE_UNDERFILLED = "pipeline_underfilled"
    STAGE_IMBALANCE = "stage_imbalance"
    CLIENT_BOUND = "client_bound"
    KV_CACHE_BOUND = "kv_cache_bound"
    PCIE_BOUND = "pcie_bound"
    THROTTLING = "throttling"
    LOG_SAMPLING_ALIASED = "log_sampling_aliased"
    PREFILL_BUDGET = "prefill_budget"
    PREFILL_BURST = "prefill_burst"
    PREFILL_STALL = "prefill_stall"
    CANNOT_TELL = "cannot_tell"


# Changes that are no engine's setting: the hardware and the offered load (how a finding names
# them -> the setting's name).
OTHER_CHANGES = {"link": "link", "cooling/power": "cooling", "client": "client", "concurrency": "concurrency"}

FLAG_KNOBS = {**{knob.flag: knob.name for words in ENGINE_WORDS.values() for knob in words.knobs},
              **OTHER_CHANGES}
"""How a user sets a thing (an engine flag, an environment variable, the hardware, the load) ->
the setting's name (``EngineSettings``' and the simulator's where they have it): the engines'
knobs (``gputrace/engines/``) and the other changes."""

LOAD_KNOBS = frozenset({"client", "concurrency"})
"""Settings of the offered load, not of the deployment."""


@dataclass(frozen=True, slots=True)
class Change:
    """A setting to change: ``knob`` its name (``FLAG_KNOBS``), ``flag`` how a user sets it, and
    the value (None where it is not one number: a layer split, more KV memory, a faster link)."""

    knob: str
    flag: str
    value: int | None = None

    @classmethod
    def of_flag(cls, flag: str, value: int | None = None) -> Change:
        return cls(FLAG_KNOBS.get(flag, flag), flag, None if value is None else int(value))

    @property
    def changes_the_deployment(self) -> bool:
        """An engine flag, an environment variable or the hardware, rather than the load."""
        return self.knob not in LOAD_KNOBS

    def to_finding_dict(self) -> JsonObject:
        """As findings.json's ``change`` gives it: the flag (under ``knob``) and the value."""
        return {"knob": self.flag, "value": self.value}


def _ns(value: JsonReadValue) -> int | None:
    """A time in ns read from JSON (None: absent or not a number)."""
    return int(value) if isinstance(value, int | float | str) else None


@dataclass(frozen=True, slots=True)
class CaptureProblem:
    """A source that delivered nothing for a while (``until_ns`` None: until the capture ended),
    as the collector records it in ``meta.extra["collector"]["source_problems"]``."""

    source: str
    reason: str
    since_ns: int | None = None
    until_ns: int | None = None

    @classmethod
    def from_dict(cls, d: JsonReadObject) -> CaptureProblem:
        """From meta.json or /v1/status (read whole)."""
        return cls(str(d.get("source")), str(d.get("reason")), _ns(d.get("since_ns")), _ns(d.get("until_ns")))

    def to_dict(self) -> JsonObject:
        """As meta.json, /healthz and /v1/status give it."""
        return {"source": self.source, "reason": self.reason, "since_ns": self.since_ns,
                "until_ns": self.until_ns}

    def note(self) -> str:
        """The report's line for it."""
        span = ("until the end of the capture" if self.until_ns is None else
                f"for {(self.until_ns - (self.since_ns or self.until_ns)) / 1e9:.0f} s")
        return f"capture problem: {self.source}: {self.reason} ({span})"


@dataclass(frozen=True, slots=True)
class LiveStatus:
    """The collector's live view (its /v1/status JSON): the run, the load phase, per pipeline stage
    the live GPU, engine and bubble figures (rows as ``LiveState.stages`` builds them), the store
    writer's health and the problems that keep the capture from being complete right now."""

    run: str | None = None
    phase: str | None = None
    target_concurrency: int | None = None
    inflight: float | None = None
    counts: Mapping[str, int] = field(default_factory=dict)
    stages: tuple[Mapping[str, Any], ...] = ()
    store: Mapping[str, Any] | None = None
    problems: tuple[CaptureProblem, ...] = ()
    pp_size: int | None = None
    # the engine once (running total against its pool, queue, micro-batches in flight), as
    # ``LiveState.engine_now`` reads it from the first stage's lines
    engine: Mapping[str, Any] | None = None
    finding: str | None = None  # what the live figures say now, in one line
    now_ns: int | None = None  # the collector's clock when it answered
    newest_data_ns: int | None = None  # its newest line or sample (watch's staleness)

    def to_dict(self) -> JsonObject:
        """The /v1/status body."""
        return {"run": self.run, "phase": self.phase, "target_concurrency": self.target_concurrency,
                "inflight": self.inflight, "counts": dict(self.counts),
                "stages": [dict(row) for row in self.stages],
                "store": None if self.store is None else dict(self.store),
                "problems": [p.to_dict() for p in self.problems],
                "pp_size": self.pp_size, "engine": None if self.engine is None else dict(self.engine),
                "finding": self.finding, "now_ns": self.now_ns, "newest_data_ns": self.newest_data_ns}

    @classmethod
    def from_dict(cls, d: JsonReadObject) -> LiveStatus:
        """From the /v1/status body (what is missing, or not of its type, stays unknown)."""
        store, engine = d.get("store"), d.get("engine")
        return cls(_str(d.get("run")), _str(d.get("phase")), _int(d.get("target_concurrency")),
                   _number(d.get("inflight")),
                   _counts(d.get("counts")),
                   tuple(row for row in _list(d.get("stages")) if isinstance(row, Mapping)),
                   store if isinstance(store, Mapping) else None,
                   tuple(CaptureProblem.from_dict(p) for p in _list(d.get("problems"))
                         if isinstance(p, Mapping)),
                   _int(d.get("pp_size")), engine if isinstance(engine, Mapping) else None,
                   _str(d.get("finding")), _int(d.get("now_ns")), _int(d.get("newest_data_ns")))


def _str(value: JsonReadValue) -> str | None:
    return value if isinstance(value, str) else None


def _int(value: JsonReadValue) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _number(value: JsonReadValue) -> float | None:
    return value if isinstance(value, int | float) and not isinstance(value, bool) else None


def _counts(value: JsonReadValue) -> dict[str, int]:
    counts = value if isinstance(value, Mapping) else {}
    return {k: n for k, v in counts.items() if (n := _int(v)) is not None}


def _list(value: JsonReadValue) -> Sequence[JsonReadValue]:
    return value if isinstance(value, list) else ()
