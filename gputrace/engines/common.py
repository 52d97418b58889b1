"""What the engines' line grammars share: ParsedLine (one recognised line, engine-neutral, made a
SchedulerEvent or EngineConfig by ``to_record``), value conversion and the log clock.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import numpy as np
import pyarrow as pa

from gputrace.engines.knobs import Knob
from gputrace.engines.simulated import SimulatedEngine
from gputrace.errors import UsageError
from gputrace.model import EngineConfig, SchedulerEvent
from gputrace.topology import Placement, is_parallel_size, sglang_placements

Value = int | float | bool | None

#: The metric fields of SchedulerEvent a line can carry, with their Python types.
METRIC_FIELDS: dict[str, type] = {
    "running_req": int,
    "queue_req": int,
    "new_seq": int,
    "new_token": int,
    "cached_token": int,
    "num_token": int,
    "token_usage": float,
    "gen_throughput_tok_s": float,
    "input_throughput_tok_s": float,
    "cuda_graph": bool,
}
RANK_FIELDS = ("dp_rank", "pp_rank", "tp_rank", "ep_rank")
# No engine writes a line this long (SGLang's server_args line is a few KB): past it a line is cut,
# by the live follower and the importer alike.
MAX_LINE_BYTES = 1 << 20

# EngineConfig's typed fields and the engine names they are read from (first found wins).
CONFIG_FIELD_NAMES: dict[str, tuple[str, ...]] = {
    "pp_size": ("pp_size", "pipeline_parallel_size"),  # SGLang's name, then vLLM's
    "tp_size": ("tp_size", "tensor_parallel_size"),
    "dp_size": ("dp_size", "data_parallel_size"),
    # the engine-wide admission limit: SGLang's request pool, vLLM's max_num_seqs
    "max_running_requests": ("max_running_requests", "max_num_seqs"),
    "pp_max_micro_batch_size": ("pp_max_micro_batch_size", "max_micro_batch_size"),
    "pp_async_batch_depth": ("pp_async_batch_depth",),
    # the prefill's token budget per turn: SGLang's chunk, vLLM's max_num_batched_tokens (a step's
    # budget shared by decode tokens and prefill chunks, chunked prefill on by default in V1)
    "chunked_prefill_size": ("chunked_prefill_size", "max_num_batched_tokens"),
    "max_total_num_tokens": ("max_total_num_tokens",),
    "decode_log_interval": ("decode_log_interval",),
}


@dataclass(frozen=True, slots=True)
class ParsedLine:
    """One recognised log line, before it is tied to a host, source and line number."""

    engine: str
    kind: str  # "prefill" | "decode" | "stats" | "config"
    ts_text: str | None = None
    log_ts_ns: int | None = None
    ts_resolution_ns: int | None = None
    dp_rank: int | None = None
    pp_rank: int | None = None
    tp_rank: int | None = None
    ep_rank: int | None = None
    values: dict[str, Value] = field(default_factory=dict)  # METRIC_FIELDS names
    config: dict[str, object] | None = None  # config lines: every field by its engine name
    # fields logged with a value the value rule refuses, as ``name='text'``: not in ``values``
    bad_values: tuple[str, ...] = ()

    def to_record(
        self, *, host: str, source: str, line_no: int, recv_ts_ns: int | None = None
    ) -> SchedulerEvent | EngineConfig:
        """The store record of this line."""
        if self.kind == "config":
            cfg = self.config or {}
            typed = {name: _config_int(cfg, keys, name in PARALLEL_SIZES)
                     for name, keys in CONFIG_FIELD_NAMES.items()}
            return EngineConfig(
                host=host, source=source, engine=self.engine, line_no=line_no,
                log_ts_ns=self.log_ts_ns, fields_json=json.dumps(cfg, default=str), **typed,
            )
        return SchedulerEvent(
            host=host, source=source, engine=self.engine, kind=self.kind, line_no=line_no,
            log_ts_ns=self.log_ts_ns, ts_resolution_ns=self.ts_resolution_ns,
            recv_ts_ns=recv_ts_ns, dp_rank=self.dp_rank, pp_rank=self.pp_rank,
            tp_rank=self.tp_rank, ep_rank=self.ep_rank,
            **self.values,  # type: ignore[arg-type]  # keys are METRIC_FIELDS, typed on parse
        )

    def to_json_obj(self) -> dict[str, object]:
        """The ``gputrace parse`` NDJSON object of this line."""
        obj: dict[str, object] = {"kind": self.kind, "engine": self.engine, "ts": self.ts_text}
        for name in RANK_FIELDS:
            obj[name] = getattr(self, name)
        for name in METRIC_FIELDS:
            obj[name] = self.values.get(name)
        if self.config:
            for key, value in self.config.items():
                obj.setdefault(key, value)  # never let a config name shadow a common key
        return obj


PARALLEL_SIZES = ("pp_size", "tp_size", "dp_size")


def _config_int(cfg: dict[str, object], keys: tuple[str, ...], is_size: bool) -> int | None:
    for key in keys:
        value = cfg.get(key)
        # past int64 it is no setting (a garbled line) and no column could hold it; a parallel
        # size outside 1..MAX_PARALLEL_SIZE is none either: None (a bad value, counted by the
        # grammar), while fields_json keeps it as logged
        if is_size:
            if is_parallel_size(value):
                return value
        elif isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63:
            return value
    return None


def config_bad_values(cfg: dict[str, object]) -> tuple[str, ...]:
    """The parallel sizes of a configuration line that are none (``pp_size=-3``): not taken."""
    bad = []
    for name in PARALLEL_SIZES:
        for key in CONFIG_FIELD_NAMES[name]:
            if key in cfg and cfg[key] is not None and not is_parallel_size(cfg[key]):
                bad.append(f"{name}={str(cfg[key])[:40]!a}")
    return tuple(bad)


_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
# One rule for every logged value, in every grammar and in the fast path: a count is a
# non-negative integer within int64, a ratio or rate a finite non-negative number; anything else
# is a bad value (counted, not stored), never a NULL that stands for "not logged".
MAX_COUNT = 2**63 - 1
_MAX_COUNT_DIGITS = len(str(MAX_COUNT))
_MAX_NUMBER_CHARS = 64  # longer number text is garbage (and float() of a huge one is slow)


_BOOLS = {"True": True, "False": False, "true": True, "false": False}


def convert_value(text: str, kind: type) -> Value:
    """A logged value as ``kind``; None when it breaks the value rule above (a garbled, truncated,
    negative, non-finite or out-of-range value)."""
    text = text.strip().rstrip("%")
    if kind is bool:
        return _BOOLS.get(text)
    if kind is int:
        digits = text.removeprefix("+")
        if not (digits.isascii() and digits.isdigit() and len(digits) <= _MAX_COUNT_DIGITS):
            return None
        count = int(digits)
        return count if count <= MAX_COUNT else None
    if len(text) > _MAX_NUMBER_CHARS or not _NUMBER.fullmatch(text):
        return None
    number = float(text)
    return number if math.isfinite(number) and number >= 0 else None


class LogClock:
    """Turns logged wall-clock text into ns since the epoch, for one timezone.

    ``date`` stands in for logs whose timestamps lack the date (SGLang before 2024-10) or the
    year (vLLM's ``MM-DD``); without it such lines get ``log_ts_ns`` None, unless ``year_until``
    gives the day the log was written up to (today, for a log followed live; the file's last
    change, for an import): an ``MM-DD`` stamp then takes the latest year that does not put it
    after that day.
    """

    def __init__(self, tz: str = "UTC", date: dt.date | str | None = None,
                 year_until: Callable[[], dt.date] | None = None):
        try:
            self.tz = dt.UTC if tz.upper() in ("UTC", "Z") else ZoneInfo(tz)
        except (ZoneInfoNotFoundError, ValueError, OSError) as exc:  # OSError: a directory ("America")
            raise UsageError(f"unknown timezone {tz[:100]!r} (use an IANA name like Europe/Berlin)") from exc
        self.is_utc = self.tz is dt.UTC
        if isinstance(date, str):
            try:
                date = dt.date.fromisoformat(date)
            except ValueError as exc:
                raise UsageError(f"--date {date!r} is not a YYYY-MM-DD date") from exc
        self.date = date
        self.year_until = year_until
        self._cache: dict[tuple[int, int, int, str], int] = {}

    def seconds(self, year: int, month: int, day: int, hms: str) -> int | None:
        """Epoch seconds of a local ``HH:MM:SS`` on a date; None when it is not a valid time."""
        if not 1970 <= year <= 2261:  # outside it, ns since the epoch leave int64: not a real stamp
            return None
        key = (year, month, day, hms)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        try:
            hour, minute, second = (int(p) for p in hms.split(":"))
            local = dt.datetime(year, month, day, hour, minute, second, tzinfo=self.tz)
            value = int(local.timestamp())
        except ValueError:
            return None
        if len(self._cache) > 100_000:
            self._cache.clear()
        self._cache[key] = value
        return value

    def to_ns(self, date_text: str | None, hms: str, frac: str | None) -> tuple[int | None, int]:
        """(epoch ns or None, resolution ns) of ``[YYYY-MM-DD ]HH:MM:SS[.fff]``."""
        resolution = 10 ** (9 - len(frac)) if frac else 1_000_000_000
        if date_text is not None:
            year, month, day = int(date_text[0:4]), int(date_text[5:7]), int(date_text[8:10])
        elif self.date is not None:
            year, month, day = self.date.year, self.date.month, self.date.day
        else:
            return None, resolution
        secs = self.seconds(year, month, day, hms)
        if secs is None:
            return None, resolution
        frac_ns = int(frac.ljust(9, "0")[:9]) if frac else 0
        return secs * 1_000_000_000 + frac_ns, resolution

    def month_day_to_ns(self, month: int, day: int, hms: str, frac: str | None) -> tuple[int | None, int]:
        """For ``MM-DD HH:MM:SS`` stamps: the year comes from ``date`` (None without it)."""
        resolution = 10 ** (9 - len(frac)) if frac else 1_000_000_000
        if self.date is not None:
            year = self.date.year
        elif self.year_until is not None:
            until = self.year_until() + dt.timedelta(days=1)  # a stamp in a timezone ahead of it
            year = until.year if (month, day) <= (until.month, until.day) else until.year - 1
        else:
            return None, resolution
        secs = self.seconds(year, month, day, hms)
        if secs is None:
            return None, resolution
        frac_ns = int(frac.ljust(9, "0")[:9]) if frac else 0
        return secs * 1_000_000_000 + frac_ns, resolution


@dataclass
class ChunkResult:
    """One chunk of a log through an engine's fast path: its line count, the fast rows as
    SchedulerEvent columns, and what is left to the per-line grammar."""

    n_lines: int
    columns: dict[str, pa.Array] = field(default_factory=dict)
    n_fast: int = 0
    kinds: dict[str, int] = field(default_factory=dict)
    line_starts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # fast rows'
    n_rejected: int = 0  # lines that cannot be scheduler lines: counted, never parsed
    leftovers: list[tuple[int, str]] = field(default_factory=list)  # (offset in chunk, line)


def join_chunks(parts: list[dict[str, pa.Array]]) -> dict[str, pa.ChunkedArray]:
    """Chunks' columns side by side as chunked arrays (no copy)."""
    return {name: pa.chunked_array([part[name] for part in parts]) for name in parts[0]}


LineGrammar = Callable[[str, LogClock], ParsedLine | None]
# (chunk, number of its first line, clock, the lines a grammar may read or None) -> its fast rows
# and the lines handed back
FastPath = Callable[[bytes, int, LogClock, "re.Pattern[bytes] | None"], ChunkResult]


@dataclass(frozen=True, slots=True)
class OutputReservation:
    """How a scheduler holds KV room for its running requests' tokens still to come when it admits
    new ones (SGLang 0.5.23: schedule_policy.PrefillAdder and NewTokenRatioTracker). A new request
    must fit its prompt and all its output; the requests running in the slot being filled hold
    ``ratio`` x their output still to come, and those of the other slots nothing beyond the KV
    they hold. The ratio starts at ``init_ratio``, falls by a step's share each decode step to
    ``init_ratio x min_ratio_factor`` over ``decay_steps``, is set after a retraction to what the
    remaining requests decoded (plus ``retract_decode_steps`` each) over their outputs, and starts
    again when the engine idles."""

    init_ratio: float
    min_ratio_factor: float
    decay_steps: int
    retract_decode_steps: int

    @property
    def min_ratio(self) -> float:
        return self.init_ratio * self.min_ratio_factor

    @property
    def decay_per_step(self) -> float:
        return (self.init_ratio - self.min_ratio) / self.decay_steps


@dataclass(frozen=True, slots=True)
class SchedulingPolicy:
    """How an engine schedules under pipeline parallelism, as the diagnosis, the simulator and the
    what-if model it."""

    # per-slot micro-batches, each capped at K (SGLang's PP loop), else admission engine-wide only
    microbatch_slots: bool
    # prefill chunks ride in the decode steps (vLLM V1's token budget), else a prefill turn runs alone
    mixed_prefill: bool
    # on a CPU the forward runs inside rank 0's scheduler loop (SGLang), so requests that arrive
    # meanwhile join the next slot
    cpu_forward_in_loop: bool
    # how admission holds KV room for running requests' future tokens; None: every running
    # request holds all of its output still to come, engine-wide
    output_reservation: OutputReservation | None = None


@dataclass(frozen=True, slots=True)
class Engine:
    """One serving engine, as every layer of gputrace asks it (each in its own package under
    gputrace/engines/, registered in gputrace/engines/__init__.py): its log grammar and fast path,
    the settings it reads from its config lines, its knobs, its stage placement rule, the words
    outputs use for it (a vLLM report in vLLM's words), the scheduling policy the simulator and
    the what-if run for it, and the log and /metrics the simulator writes for it."""

    kind: str  # the store's engine name: "sglang", "vllm"
    name: str  # as people write it: "SGLang"
    knobs: tuple[Knob, ...]  # the settings a finding, the what-if or the advice can change
    log_fields: tuple[str, ...]  # the field names its scheduler lines carry ("#running-req")
    placement_rule: str  # how the report names the rule that put its ranks on GPUs
    placement_source: str  # the same in meta.json's topology.source ("sglang-formula")
    policy: SchedulingPolicy  # what the simulator and the what-if run for it
    parse_line: LineGrammar  # one line -> ParsedLine, None where it is not the engine's
    maybe_line: re.Pattern[bytes]  # every line parse_line reads holds a match
    # its scheduler lines log each micro-batch step (SGLang's batch lines: steps and tokens are
    # counted from them), else periodic windows of engine-wide figures (vLLM's stats lines)
    steps_logged: bool = True
    # its log's stamps carry the year (vLLM's ``MM-DD`` do not: the import dates them by the file)
    stamps_have_year: bool = True
    fast_path: FastPath | None = None  # a vectorised reader of its commonest lines
    other_words: tuple[str, ...] = ()  # flags and variables it has beyond its knobs
    kv_advice: str = ""  # how a user gives its KV cache more memory, in its flags
    log_advice: str = ""  # how its log shows every step (a flag), "" where it cannot
    # how a user gets its own per-stage busy timers, None where it has none
    stage_timers: str | None = None
    # its /metrics counter of generated (output) tokens, read for a phase's throughput where its
    # log resolves tokens only to its stats windows (vLLM's 10 s averages); None: the log's
    generated_tokens_counter: str | None = None
    # what the simulator writes for it (its log, its /metrics), None where it is not simulated
    simulated: SimulatedEngine | None = None
    # micro-batches in flight at most under PP, from pp_size and pp_async_batch_depth (None where
    # not set); by default pp_size (vLLM's batch queue)
    slot_count: Callable[[int, int | None], int] = lambda pp_size, _depth: pp_size

    @property
    def microbatch_slots(self) -> bool:
        """Per-slot micro-batches with their own cap K (SGLang's PP scheduler); vLLM admits
        engine-wide."""
        return self.policy.microbatch_slots

    @property
    def flags(self) -> dict[str, str]:
        """gputrace's setting name (EngineSettings, the simulator, Change.knob) -> how a user sets it."""
        return {k.name: k.flag for k in self.knobs}

    def knob_named(self, name: str) -> Knob | None:
        """The knob of gputrace's setting ``name``; None where the engine has no such setting."""
        return next((k for k in self.knobs if k.name == name), None)

    def knob_of_flag(self, flag: str) -> Knob | None:
        return next((k for k in self.knobs if k.flag == flag), None)

    def knob_of_param(self, param: str) -> Knob | None:
        """The knob the simulator's parameter ``param`` models on this engine."""
        return next((k for k in self.knobs if k.sim_param == param), None)

    def flag_for(self, knob: str) -> str:
        """The engine's flag for a setting; the setting's name where the engine has no flag."""
        return self.flag(knob) or knob

    def flag(self, knob: str) -> str | None:
        """The engine's flag for a setting, None where the engine has no such setting."""
        found = self.knob_named(knob)
        return None if found is None else found.flag

    def setting(self, knob: str) -> str:
        """The engine's own name for a setting."""
        found = self.knob_named(knob)
        return knob if found is None else found.own_name

    def knob(self, setting: str) -> str:
        """gputrace's setting name for the engine's own (``max_num_seqs`` -> ``max_running_requests``
        on vLLM): what the simulator and the what-if take, from what the advice shows."""
        return next((k.name for k in self.knobs if k.setting == setting), setting)

    def knob_names(self) -> tuple[str, ...]:
        """The settings a user can name for this engine, in its own words."""
        return tuple(k.own_name for k in self.knobs if k.settable)

    def placements(self, host: str, *, pp_size: int, tp_size: int, nnodes: int = 1, node_rank: int = 0,
                   base_gpu_id: int = 0, gpu_id_step: int = 1) -> list[Placement]:
        """The GPUs of ``host`` (node ``node_rank`` of ``nnodes``) and the ranks the engine puts on
        them. Both engines place rank pp_rank * tp_size + tp_rank on a node's GPU of that index
        (SGLang's formula, which also spreads the stages over nodes, vLLM's rank order)."""
        return sglang_placements(host, pp_size=pp_size, tp_size=tp_size, nnodes=nnodes, node_rank=node_rank,
                                 base_gpu_id=base_gpu_id, gpu_id_step=gpu_id_step)

    def microbatch_cap(self, pool: int, pp_size: int, set_cap: int | None = None) -> int:
        """The requests one micro-batch holds at most: on a slot scheduler its cap K (``set_cap``
        where set, else the K knob's default), elsewhere the engine-wide limit ``pool``."""
        knob = self.knob_named("pp_max_micro_batch_size")
        if not self.microbatch_slots or knob is None:
            return pool
        if set_cap is not None:
            return set_cap
        default = knob.default_for({"max_running_requests": pool, "pp_size": pp_size})
        return pool if default is None else default

    def vocabulary(self) -> frozenset[str]:
        """Every engine-specific word: its name, flags, setting names and log fields."""
        return frozenset({self.name, *self.flags.values(), *self.knob_names(), *self.log_fields,
                          *self.other_words})


# The name the engine had while it held only its words.
EngineWords = Engine
