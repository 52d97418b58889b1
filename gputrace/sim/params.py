"""The simulator's parameters, the scenario presets built on them, and overrides (``--set key=value``
or a TOML file). Every field of SimParams can be overridden by name.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gputrace.config import TomlValue
from gputrace.engines import ENGINE_WORDS, Engine, engine_words
from gputrace.errors import ConfigError, UsageError

# The value of one of SimParams' fields (what the overrides, the scenarios, the fixes and the
# what-if's changes set): a number (a bool is one), a tuple (the load's levels, a layer split, the
# recorded requests' lengths), a string (the engine; a ``--set`` value as typed, which make_params
# coerces), None (the engine's default, or no limit)
ParamValue = int | float | str | tuple[int, ...] | tuple[float, ...] | tuple[tuple[int, int], ...] | None
# Field values by name as they come in (a scenario, --set, a TOML file): checked and coerced to each
# field's type by make_params
Overrides = Mapping[str, object]


@dataclass(frozen=True, slots=True)
class SimParams:
    """One simulated deployment and the load offered to it. Times in seconds."""

    # -- the deployment (SGLang server arguments) ---------------------------------------------
    engine: str = "sglang"  # "sglang": per-micro-batch admission; "vllm": engine-wide max_num_seqs
    pp_size: int = 8
    tp_size: int = 1
    # SGLang: the request pool's rows (the engine-wide bound); vLLM: max_num_seqs
    max_running_requests: int = 64
    # K, the bound of each micro-batch (SGLang only); None: SGLang's default max(mrr // pp_size, 1)
    pp_max_micro_batch_size: int | None = None
    pp_async_batch_depth: int = 0
    chunked_prefill_size: int = 8192
    max_prefill_tokens: int = 16384
    max_total_num_tokens: int = 600_000  # KV-cache capacity in tokens (per stage, all layers of it)
    context_len: int = 32768
    decode_log_interval: int = 9  # coprime with the slot count, as the report recommends
    # SGLANG_ENABLE_METRICS_DEVICE_TIMER=1: batch lines end with `fwd occupancy: X%, fwd+idle
    # occupancy: Y%` (the rank's forward time over the wall time since its previous line)
    device_timer: bool = False
    cuda_graph_max_bs: int = 160
    model_path: str = "meta-llama/Llama-3.1-70B-Instruct"
    # -- cost model of one stage step (before the stage's multiplier) ---------------------------
    launch_s: float = 0.00062  # fixed cost of a forward step (launch, sync, sampling)
    weight_read_s: float = 0.00269  # memory-bound floor: reading the stage's weights once
    decode_token_s: float = 0.000374  # compute per decoded token (dominates past the knee)
    prefill_token_s: float = 0.00002  # compute per prompt token of a prefill chunk
    context_token_s: float = 3.85e-8  # attention: per context token the batch holds
    stage_cost_multipliers: tuple[float, ...] = ()  # per stage (uneven layer split); () = all 1
    # MoE: reading the experts a step's tokens touch, E * (1 - (1 - top_k / E) ** tokens) of the
    # E routed experts, at expert_read_s for all E (0 experts: a dense model)
    moe_experts: int = 0
    moe_top_k: int = 8
    expert_read_s: float = 0.0
    sched_overhead_s: float = 0.00005  # stage 0's CPU time per loop iteration
    # SGLang on the CPU runs each forward inside its scheduler loop (on a GPU the launch is
    # asynchronous): requests that arrive during rank 0's forward go to the next slot it visits
    synchronous_forward: bool = False
    # Stages that share one host's cores (a CPU engine: every rank, the server and the client on
    # the same cores): their forwards run on this many cores together, so a stage computes at full
    # speed only while fewer than this many others compute (0: each stage has its own device)
    shared_cores: float = 0.0
    # Rank 0's work per request waiting in the queue, each step it runs (fitted on a CPU run: SGLang
    # at PP=2 here stepped C=16 with 8 queued at 35 ms a stage step of 4, where C=1 and C=4 put a
    # step of 4 at 27 ms and the same level without a queue, batches of 8, at 45)
    queued_request_s: float = 0.0
    # -- activation hand-off between stages over PCIe ------------------------------------------
    activation_bytes_per_token: int = 16384  # hidden 8192 x bf16
    pcie_bandwidth_bytes_per_s: float = 25e9
    pcie_latency_s: float = 0.00002
    # -- the client ---------------------------------------------------------------------------
    concurrency: tuple[int, ...] = (1, 8, 32, 64)
    # "closed": each level keeps C requests in flight for phase_s; "burst": each level sends its C
    # requests at once and ends when the last finishes (phase_s bounds it), as the motivating
    # measurements were taken
    client_mode: str = "closed"
    phase_s: float = 150.0
    drain_s: float = 30.0  # after the last phase: let in-flight requests finish this long
    input_tokens: int = 128
    input_tokens_jitter: float = 0.0  # +- fraction, uniform
    # A mixed load: this share of the requests send long prompts of long_input_tokens (jittered as
    # input_tokens), the others input_tokens (0: every prompt drawn around input_tokens)
    long_prompt_share: float = 0.0
    long_input_tokens: int = 0
    # The share of each prompt the engine's prefix cache already holds (a load whose prompts repeat
    # a prefix: SGLang logs it as #cached-token): not computed, but held in the KV cache for its
    # request like the rest of its prompt (the engine tier's short prompts: 2 new tokens a turn
    # against 58-69 cached)
    prefix_cached_share: float = 0.0
    max_tokens: int = 2048
    output_tokens_jitter: float = 0.0  # fraction of requests end early, uniformly in [1-j, 1]
    # A recorded load: the (prompt, output) tokens of each request in the order the client sends
    # them (a what-if replays a captured run's own requests; a throughput under a small KV cache or
    # a bunched schedule moves 10-15 % with which prompts are drawn); 0 where a length is not known
    # and past the end, lengths are drawn as above
    request_lengths: tuple[tuple[int, int], ...] = ()
    # When each request of a burst goes out after its level's start, in the order sent (0 past the
    # end): a client sends a burst one request after another, and the engine starts a turn on the
    # first to land (the demo's live C=32 bursts went out over 10-50 ms: turns of 1, 7, 8, 8, 8;
    # a what-if replays a burst load's own, whatif.fit.burst_offsets)
    burst_offsets_s: tuple[float, ...] = ()
    client_max_inflight: int | None = None  # a client that cannot keep up
    think_s: float = 0.0
    client_latency_s: float = 0.0005  # HTTP + tokenizer, each way
    # -- the GPUs and their samples ------------------------------------------------------------
    gpu_name: str = "NVIDIA H100 PCIe"
    power_limit_w: float = 350.0
    idle_power_w: float = 60.0
    pcie_gen: int = 5
    pcie_width: int = 16
    memory_total_bytes: int = 85_899_345_920
    weights_bytes_per_gpu: int = 18_000_000_000
    kv_bytes_per_token_per_gpu: int = 40_960
    sample_period_s: float = 0.1
    # NCCL P2P receive on one node spins a kernel while a rank waits for its input: utilization.gpu
    # then reads ~100 % while the engine has work (the non-zero ranks even when idle: sglang PR
    # #10489); SM activity and power still follow the compute. False: a transport that waits idle.
    nccl_spin: bool = False
    power_noise_w: float = 3.0
    # -- the run -------------------------------------------------------------------------------
    seed: int = 0
    start: str = "2026-01-15T10:00:00Z"  # virtual start time (UTC)

    @property
    def engine_spec(self) -> Engine:
        """The simulated engine as gputrace/engines/ registers it: its scheduling policy and knobs."""
        return engine_words(self.engine)

    @property
    def micro_batch_cap(self) -> int:
        """SGLang's effective pp_max_micro_batch_size (vLLM has none: its max_num_seqs)."""
        return engine_words(self.engine).microbatch_cap(self.max_running_requests, self.pp_size,
                                                        self.pp_max_micro_batch_size)

    @property
    def slots(self) -> int:
        """Micro-batches in flight at most, by the engine's rule: SGLang's PP loop slots (pp_size +
        pp_async_batch_depth), vLLM's batch queue (pp_size)."""
        return self.engine_spec.slot_count(self.pp_size, self.pp_async_batch_depth)

    @property
    def draws_lengths(self) -> bool:
        """Whether a run draws its requests' lengths at random: the only use of the seed in the
        engine and its client, so a run that draws none is the same at every seed."""
        return bool(self.input_tokens_jitter or self.output_tokens_jitter or self.long_prompt_share)

    def lengths_of(self, index: int) -> tuple[int, int] | None:
        """The recorded (prompt, output) tokens of the ``index``-th request sent, 0 where not
        known; None past the recording."""
        return self.request_lengths[index] if index < len(self.request_lengths) else None

    def burst_offset_s(self, index: int) -> float:
        return self.burst_offsets_s[index] if index < len(self.burst_offsets_s) else 0.0

    def replaced(self, values: Mapping[str, ParamValue]) -> SimParams:
        """These parameters with ``values`` (by field name, each of its field's type: a fix's)."""
        return dataclasses.replace(self, **values)  # type: ignore[arg-type]  # typed per field by the caller

    def stage_multiplier(self, stage: int) -> float:
        m = self.stage_cost_multipliers
        return float(m[stage]) if stage < len(m) else 1.0


def parse_start_ns(text: str) -> int:
    """``2026-01-15T10:00:00Z`` (SimParams.start) -> ns since the epoch (UTC when no zone is given)."""
    stamp = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=dt.UTC)
    return int(stamp.timestamp()) * 1_000_000_000 + stamp.microsecond * 1000


class _EngineText(dict[str, str]):
    """A scenario text's ``{setting}`` in its engine's flag (``{pp_max_micro_batch_size}`` ->
    ``--pp-max-micro-batch-size`` on SGLang) and ``{engine}`` in its name, from its knobs."""

    def __init__(self, engine: Engine):
        super().__init__(engine=engine.name)
        self.engine = engine

    def __missing__(self, setting: str) -> str:
        return self.engine.flag_for(setting)


@dataclass(frozen=True, slots=True)
class Scenario:
    """A preset: parameter overrides and the causes it is built to show."""

    name: str
    # what it shows, the engine's flags and name written ``{setting}`` and ``{engine}``
    text: str
    overrides: Overrides
    causes: tuple[str, ...]

    @property
    def summary(self) -> str:
        """What it shows, in its engine's flags."""
        engine = self.overrides.get("engine")
        return self.text.format_map(_EngineText(engine_words(engine if isinstance(engine, str) else None)))


# The motivating deployment's cost model, fitted to its measured figures (Kimi K2.6, PP8 on 8 PCIe
# GPUs; `python bench/calibration.py --fit`): the step reads the stage's dense weights and the
# routed experts its tokens touch (384 experts, top-8), a prompt token costs prefill_token_s per
# stage. Two deployment facts the figures do not state were fitted with it: the prompt length (a
# burst's prompts fill SGLang's 8,192-token prefill budget 8 at a time, so C=32 spreads over 4
# micro-batches whatever K allows) and the KV-cache capacity (it keeps the 4,096-token bursts at
# C=32 and C=48 from running all at once: 105,000 tokens under SGLang's admission, which holds
# room for the outputs of the slot it fills only, at new_token_ratio; 156,000 fitted the
# engine-wide reservation the simulator had before). Nothing about the scheduler is fitted.
KIMI_K26_PCIE_COST: Mapping[str, int | float] = {
    "moe_experts": 384, "moe_top_k": 8, "launch_s": 0.0006, "decode_token_s": 1e-6,
    "weight_read_s": 0.00123, "expert_read_s": 0.0572, "prefill_token_s": 2.14e-4,
    "input_tokens": 1024, "max_total_num_tokens": 105_000,
}

# Where the pipeline stays full: SGLang's per-micro-batch cap of 8 (64 // 8) with 64 requests in
# flight fills all 8 slots. The single-cause scenarios below change one thing from it.
_FULL_PIPELINE: Overrides = {
    "input_tokens": 256, "input_tokens_jitter": 0.3,
    "max_tokens": 1024, "output_tokens_jitter": 0.5, "concurrency": (64,), "phase_s": 120.0,
}

SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("motivating", "the deployment that started gputrace, with its defaults: PP8 TP1, "
                 "max_running_requests 64 (K = 64 // 8 = 8 per micro-batch); below 64 requests the "
                 "load fills fewer micro-batches than stages", {}, ("pipeline_underfilled",)),
        Scenario("microbatch-cap", "{pp_max_micro_batch_size} 2 below a pool of 64: every micro-batch "
                 "at K = 2, 16 running, the pool's other rows free while requests wait",
                 {"pp_max_micro_batch_size": 2}, ("microbatch_cap",)),
        Scenario("microbatch-fixed", "the same deployment with K back at its default of 8",
                 {"pp_max_micro_batch_size": 8}, ("pipeline_underfilled",)),
        Scenario("pool-bound", "max_running_requests 32 under a load of 64: every slot full at its "
                 "default K of 4, the pool is the bound and requests wait",
                 {**_FULL_PIPELINE, "max_running_requests": 32}, ("admission_bound",)),
        Scenario("bunched", "{pp_max_micro_batch_size} 64 at a load of 32: requests that arrive together "
                 "share one or two micro-batches, most stages idle",
                 {**_FULL_PIPELINE, "pp_max_micro_batch_size": 64, "concurrency": (32,)},
                 ("pipeline_underfilled",)),
        Scenario("bunched-at-pool", "{pp_max_micro_batch_size} 64 with max_running_requests 32 under a "
                 "load of 64: the pool binds, and the 32 it runs share one micro-batch",
                 {**_FULL_PIPELINE, "max_running_requests": 32, "pp_max_micro_batch_size": 64},
                 ("admission_bound", "pipeline_underfilled")),
        Scenario("healthy", "64 requests fill every micro-batch slot: no bubbles",
                 _FULL_PIPELINE, ()),
        Scenario("stage-imbalance", "stage 3 holds 60 % more layers than the others",
                 {**_FULL_PIPELINE, "stage_cost_multipliers": (1.0, 1.0, 1.0, 1.6, 1.0, 1.0, 1.0, 1.0)},
                 ("stage_imbalance",)),
        Scenario("client-bound", "the client keeps at most 12 requests in flight whatever it is asked",
                 {**_FULL_PIPELINE, "concurrency": (32, 64), "client_max_inflight": 12},
                 ("client_bound",)),
        Scenario("kv-bound", "a small KV cache: token usage near 1.0 and admission stalls",
                 {**_FULL_PIPELINE, "concurrency": (32, 64), "input_tokens": 4096,
                  "input_tokens_jitter": 0.2, "max_tokens": 1024, "max_total_num_tokens": 90_000},
                 ("kv_cache_bound",)),
        Scenario("pcie-bound", "stages hand activations over a degraded PCIe link (gen1 x1); 12 slots "
                 "({pp_async_batch_depth} 4) keep the links busy",
                 {**_FULL_PIPELINE, "pp_async_batch_depth": 4, "max_running_requests": 96,
                  "pp_max_micro_batch_size": 8, "concurrency": (96,), "input_tokens": 64,
                  "activation_bytes_per_token": 131072,
                  "pcie_bandwidth_bytes_per_s": 0.2e9, "pcie_latency_s": 0.0002,
                  "pcie_gen": 1, "pcie_width": 1,
                  # coprime with its 12 slots (9 shares 3: each rank would log 4 of the 12)
                  "decode_log_interval": 13},
                 ("pcie_bound",)),
        Scenario("log-aliased", "the healthy pipeline logged with {engine}'s default "
                 "{decode_log_interval} 40: 8 slots divide it, so each stage keeps logging one slot",
                 {**_FULL_PIPELINE, "decode_log_interval": 40}, ("log_sampling_aliased",)),
        Scenario("prefill-burst", "the motivating deployment as its figures were measured: bursts of 32 "
                 "prompts of 1,024 tokens, K raised to 64; SGLang's 8,192-token prefill budget admits 8 "
                 "a turn, so the 32 run as 4 micro-batches for 8 stages",
                 {**KIMI_K26_PCIE_COST, "client_mode": "burst", "concurrency": (32,), "max_tokens": 512,
                  "output_tokens_jitter": 0.1, "pp_max_micro_batch_size": 64, "phase_s": 600.0,
                  "drain_s": 0.0}, ("prefill_burst",)),
        Scenario("prefill-chunk", "prompts of 950-1,900 tokens cut into 256-token chunks where a forward "
                 "costs about the same up to a few hundred tokens (a small model; SGLang on a CPU): one "
                 "chunked request at a time, the others wait for its turns",
                 {"pp_size": 2, "max_running_requests": 16, "chunked_prefill_size": 256,
                  "max_prefill_tokens": 4096, "context_len": 2048, "input_tokens": 1425,
                  "input_tokens_jitter": 0.333, "max_tokens": 32, "concurrency": (8, 12), "phase_s": 60.0,
                  # the step's flat part 10x the default's, a token's cost as it is
                  "drain_s": 5.0, "launch_s": 0.0062, "weight_read_s": 0.0269, "max_total_num_tokens": 65536},
                 ("prefill_budget",)),
        Scenario("prefill-mixed", "a mixed load: 1 request in 10 sends a 16,384-token prompt among "
                 "prompts of about 256, cut into {engine}'s 8,192-token chunks; a long chunk holds each "
                 "stage about 50 decode steps long, and the other micro-batches' decodes wait behind it at "
                 "every stage",
                 {**_FULL_PIPELINE, "long_prompt_share": 0.1, "long_input_tokens": 16384, "max_tokens": 256,
                  "concurrency": (48,)},
                 ("prefill_stall",)),
        Scenario("vllm-admission", "{engine}, PP8, {max_running_requests} 32 under a load of 64: the "
                 "engine runs 32, its limit, and the rest wait",
                 {**_FULL_PIPELINE, "engine": "vllm", "max_running_requests": 32}, ("admission_bound",)),
    )
}

_FIELDS = {f.name: f for f in dataclasses.fields(SimParams)}


def scenario_params(name: str, overrides: Overrides | None = None) -> SimParams:
    """A scenario's parameters with ``overrides`` (by field name) applied on top."""
    try:
        scenario = SCENARIOS[name]
    except KeyError:
        raise UsageError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}") from None
    merged = {**scenario.overrides, **(overrides or {})}
    return make_params(merged)


def make_params(values: Overrides) -> SimParams:
    """SimParams from field values, each checked and coerced to the field's type."""
    coerced: dict[str, ParamValue] = {}
    for key, value in values.items():
        if key not in _FIELDS:
            raise ConfigError(f"unknown simulator parameter {key!r}; known: {', '.join(sorted(_FIELDS))}")
        coerced[key] = _coerce(key, value)
    params = SimParams(**coerced)  # type: ignore[arg-type]  # each value coerced to its field's type
    _validate(params)
    return params


def _coerce(key: str, value: Any) -> ParamValue:  # Any: whatever a file or --set gave
    default = _FIELDS[key].default
    optional_int = key in ("pp_max_micro_batch_size", "client_max_inflight")
    if value is None or (isinstance(value, str) and value.lower() in ("none", "")):
        if optional_int:
            return None
        raise ConfigError(f"simulator parameter {key}: a value is required")
    try:
        if key == "request_lengths":  # pairs, each (prompt, output) tokens
            pairs = tuple((int(a), int(b)) for a, b in value)
            if any(a < 0 or b < 0 for a, b in pairs):
                raise ValueError(key)
            return pairs
        if isinstance(default, tuple):
            items = value.split(",") if isinstance(value, str) else list(value)
            kind = int if key == "concurrency" else float
            return tuple(kind(str(v).strip()) for v in items if str(v).strip())
        if isinstance(default, bool):
            return str(value).lower() in ("1", "true", "yes")
        if isinstance(default, int) or optional_int:
            return int(float(value)) if isinstance(value, str) and "e" in value.lower() else int(value)
        if isinstance(default, float):
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"simulator parameter {key}: cannot use {value!r}") from None


def _validate(p: SimParams) -> None:
    checks = [
        (p.pp_size >= 1 and p.tp_size >= 1, "pp_size and tp_size must be >= 1"),
        (p.max_running_requests >= 1, "max_running_requests must be >= 1"),
        (p.pp_max_micro_batch_size is None or p.pp_max_micro_batch_size >= 1,
         "pp_max_micro_batch_size must be >= 1"),
        (p.pp_async_batch_depth >= 0, "pp_async_batch_depth must be >= 0"),
        # the registered engines: the simulator runs each one's scheduling policy (Engine.policy)
        (p.engine in ENGINE_WORDS, f"engine must be one of {', '.join(ENGINE_WORDS)}"),
        (p.client_mode in ("closed", "burst"), "client_mode must be closed or burst"),
        (p.engine_spec.microbatch_slots or (p.pp_max_micro_batch_size is None and not p.pp_async_batch_depth),
         "pp_max_micro_batch_size and pp_async_batch_depth are SGLang settings (engine = sglang)"),
        (p.decode_log_interval >= 1, "decode_log_interval must be >= 1"),
        (0.0 <= p.prefix_cached_share < 1.0, "prefix_cached_share must be in [0, 1)"),
        (bool(p.concurrency) and min(p.concurrency) >= 1, "concurrency needs levels >= 1"),
        (p.phase_s > 0 and p.sample_period_s > 0, "phase_s and sample_period_s must be > 0"),
        (p.input_tokens >= 1 and p.max_tokens >= 1, "input_tokens and max_tokens must be >= 1"),
        (p.pcie_bandwidth_bytes_per_s > 0, "pcie_bandwidth_bytes_per_s must be > 0"),
        (p.shared_cores == 0 or p.shared_cores >= 1, "shared_cores must be 0 (no sharing) or >= 1"),
        (p.queued_request_s >= 0, "queued_request_s must be >= 0"),
        (p.chunked_prefill_size >= 1, "chunked_prefill_size must be >= 1"),
        (0.0 <= p.long_prompt_share <= 1.0, "long_prompt_share must be in 0..1"),
        (not p.long_prompt_share or p.long_input_tokens >= 1,
         "long_input_tokens must be >= 1 where long_prompt_share is set"),
        (p.moe_experts == 0 or 1 <= p.moe_top_k <= p.moe_experts, "moe_top_k must be in 1..moe_experts"),
        (p.client_max_inflight is None or p.client_max_inflight >= 1, "client_max_inflight must be >= 1"),
        (not p.stage_cost_multipliers or len(p.stage_cost_multipliers) == p.pp_size,
         "stage_cost_multipliers needs one value per stage"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(f"simulator parameters: {message}")


def parse_set_options(items: tuple[str, ...] | list[str]) -> dict[str, str]:
    """``("pp_size=4", "concurrency=1,8")`` -> {"pp_size": "4", "concurrency": "1,8"}."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--set {item!r}: expected key=value")
        out[key.strip()] = value.strip()
    return out


def load_params_file(path: str | Path) -> dict[str, TomlValue]:
    """Overrides from a TOML file: top-level keys, or a ``[sim]`` table."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    table = data.get("sim", data)
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [sim] must be a table")
    return dict(table)
