"""Interleaved pairs on the real SGLang (`bench/whatif_engines.py --pairs`): one change with a large
effect, its default and the changed setting run back to back A B A B A B, as [prefill] Must-show 1
and 5 ask (issue 47). Per run: the client's tok/s over the level and the scheduler's CPU-seconds
(`sglang:scheduler_process_cpu_seconds_total`, both ranks) over the same window; per pair the ratio
changed / default per wall second and per scheduler CPU-second (the second cancels the share of the
two cores other work took meanwhile); the median over the pairs beside the what-if's prediction
fitted to the first default run, with its band.

The chunk case is the long-prompt run of issue 47 (prompts of 950-1,900 tokens,
`--chunked-prefill-size 256`, closed loop C=8): the changed chunk is the one gputrace's report
advises on the default run (its finding's where the advice keeps), and a sweep of chunks, each run
beside a default, finds the best chunk measured.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from engine_servers import LONG_PROMPT_FLAGS, EngineSetting, MetricsScraper, capture_level, running_engine

from gputrace.analyse import analyse_run
from gputrace.analysis.result import Analysis
from gputrace.store import Store

CPU_METRIC = "sglang:scheduler_process_cpu_seconds_total"
BAND_LIMIT = 0.25  # Must-show 5: predicted within 25 % of the measured median ratio


@dataclass(frozen=True, slots=True)
class PairCase:
    """A default setting and one change of it, with the load both run under."""

    name: str
    base_flags: tuple[str, ...]  # the default run's flags beyond the engine tier's
    flag: str  # the changed setting
    knob: str  # its what-if name
    default_value: int
    changed_value: int | None  # None: the value gputrace's report advises on the default run
    concurrency: int
    max_tokens: int
    level_s: float
    warmup_s: float = 0.0
    long_prompts: bool = False

    def flags(self, value: int) -> tuple[str, ...]:
        return (*self.base_flags, self.flag, str(value))


# The default of each case binds on its own knob at the case's load (the tier's flags otherwise:
# max_running_requests 8, 16,384 KV tokens, K = 8 // 2): K 2 holds 4 of 8 (2 slots of 2); a pool
# of 4 rows holds 4 of 16 (K 8 set so that only the pool binds); 320 KV tokens hold about 4
# requests of 25 prompt and 64 output tokens; a 256-token chunk takes a long prompt 4-8 turns
# (at 1.6-3 s a turn on the shared cores the closed loop's first outputs come 30-60 s in, and a
# request of 32 tokens took 100 s: 16 tokens, and a warm-up that runs that start before the phase).
CASES = {c.name: c for c in (
    PairCase("chunk", LONG_PROMPT_FLAGS, "--chunked-prefill-size", "chunked_prefill_size", 256, None,
             8, 16, 60.0, warmup_s=45.0, long_prompts=True),
    PairCase("k", (), "--pp-max-micro-batch-size", "pp_max_micro_batch_size", 2, 6, 8, 32, 30.0),
    PairCase("pool", ("--pp-max-micro-batch-size", "8"), "--max-running-requests", "max_running_requests",
             4, 16, 16, 32, 30.0),
    PairCase("kv", (), "--max-total-tokens", "max_total_num_tokens", 320, 16384, 8, 64, 30.0),
)}


@dataclass(frozen=True, slots=True)
class RunFigures:
    """One run: what the client got over the level and what the scheduler spent meanwhile."""

    setting: str
    value: int
    tok_s: float  # the client's completion tokens over the level
    cpu_s: float  # scheduler process CPU-seconds over the level, both PP ranks
    wall_s: float

    @property
    def tok_per_cpu_s(self) -> float:
        return self.tok_s * self.wall_s / self.cpu_s if self.cpu_s > 0 else 0.0


def _cpu_at(series: list[list[float]], ts_ns: int) -> float:
    """The scheduler CPU counter (summed over ranks) at ``ts_ns``, interpolated between scrapes."""
    before = [s for s in series if s[0] <= ts_ns] or series[:1]
    after = [s for s in series if s[0] >= ts_ns] or series[-1:]
    (t0, v0), (t1, v1) = before[-1], after[0]
    return v0 if t1 == t0 else v0 + (v1 - v0) * (ts_ns - t0) / (t1 - t0)


def run_one(case: PairCase, value: int, work: Path, prompts: Path | None) -> RunFigures:
    """Start SGLang at ``value``, capture one level with `gputrace run` (its log and the engine's
    /metrics, as a user captures it), stop it; the level's figures. ``work`` keeps the capture and
    the scheduler's CPU counter as scraped (cpu.json), which :func:`figures_of` reads again; a run
    kept there already is read, not run again (an interrupted bench goes on where it stopped)."""
    if (work / "cpu.json").exists():
        return figures_of(case, value, work)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    log = work / "engine.log"
    with running_engine(EngineSetting("sglang", f"{case.name}-{value}", case.flags(value)), log) as engine, \
            MetricsScraper(engine, period_s=1.0) as scraper:
        out = capture_level(engine, work / "run", concurrency=case.concurrency, level_s=case.level_s,
                            max_tokens=case.max_tokens, prompts=prompts, warmup_s=case.warmup_s)
        if out.returncode != 0:
            raise SystemExit(f"{case.name}={value}: gputrace run failed: {out.stderr[-1500:]}")
    series = scraper.series(CPU_METRIC)  # with the scrape the scraper takes once the load is done
    if not series:
        raise SystemExit(f"the engine's /metrics has no {CPU_METRIC} (SGLang 0.5.23+, --enable-metrics)")
    (work / "cpu.json").write_text(json.dumps(series))
    return figures_of(case, value, work)


def figures_of(case: PairCase, value: int, work: Path) -> RunFigures:
    """The kept run's level: the client's tok/s and the scheduler CPU-seconds over its window."""
    # the case's level (a warm-up before it is a phase of its own)
    (pm,) = [pm for pm in analysis_of(work).metrics if pm.label == f"C={case.concurrency}"]
    series = json.loads((work / "cpu.json").read_text())
    tok_s = pm.client_throughput_tok_s if pm.client_throughput_tok_s is not None else pm.throughput_tok_s
    return RunFigures(case.flag, value, float(tok_s or 0.0),
                      _cpu_at(series, pm.end_ns) - _cpu_at(series, pm.start_ns), pm.duration_s)


def analysis_of(work: Path) -> Analysis:
    with Store.open(work / "run", read_only=True) as store:
        return analyse_run(store, effects=False)


def ratios(pairs: list[tuple[RunFigures, RunFigures]]) -> tuple[list[float], list[float]]:
    """Per pair, changed / default per wall second and per scheduler CPU-second."""
    wall = [b.tok_s / a.tok_s for a, b in pairs if a.tok_s > 0]
    cpu = [b.tok_per_cpu_s / a.tok_per_cpu_s for a, b in pairs if a.tok_per_cpu_s > 0]
    return wall, cpu


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def elapsed(t0: float) -> str:
    return f"{time.monotonic() - t0:.0f} s"


def run_dirs(work: Path) -> dict[str, Path]:
    """A kept case's runs by name: A0, B0, A1, ... (the pairs) and S<value> (the sweep)."""
    return {d.name: d for d in sorted(work.iterdir()) if d.is_dir() and (d / "cpu.json").exists()}
