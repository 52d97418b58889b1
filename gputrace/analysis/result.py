"""One call from a run's tables (or whatever reads them: a store) to the full analysis: aligned
streams, phases, metrics, findings."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from gputrace.analysis.aligned_run import AlignedRun, align
from gputrace.analysis.diagnose import Finding, Thresholds, diagnose
from gputrace.analysis.engine_metrics import (
    COMPARED,
    MetricSeries,
    disagreement_notes,
    series_from_columns,
    with_engine_counter,
    with_engine_steps,
    with_engine_timers,
)
from gputrace.analysis.phase_figures import (
    BUSY_RANKING,
    BUSY_SIGNALS,
    PhaseMetrics,
    StageSeries,
    phase_metrics,
    prefill_budget,
    stage_series,
)
from gputrace.analysis.phases import (
    Phase,
    detect_phases,
    phases_from_markers,
    phases_from_request_labels,
)
from gputrace.analysis.predicted import PredictedEffect
from gputrace.log_clock import corrected_note
from gputrace.run_tables import EngineMetricColumns, RunSource, RunTables
from gputrace.vocabulary import CaptureProblem


class Advice(Protocol):
    """The advice for the deployment, computed after the findings from the whole analysis (the
    advisor, ``gputrace.analyse.Advise``, produces it); findings.json carries ``to_dict()`` as
    ``advice``."""

    def to_dict(self) -> Mapping[str, Any]: ...


@dataclass(frozen=True)
class Analysis:
    """The result of analysing one run: what every output renders. Immutable: a later step (the
    what-if's predicted effects, the advice, the store's notes) makes a new one with
    ``dataclasses.replace``, never edits this one or its findings."""

    run: AlignedRun
    series: StageSeries
    phases: tuple[Phase, ...]
    metrics: tuple[PhaseMetrics, ...]
    findings: tuple[Finding, ...]  # most important first
    notes: tuple[str, ...] = ()
    thresholds: Thresholds = field(default_factory=Thresholds)  # what the rules were applied with
    # the what-if model's effect of a finding's change, by Finding.key (gputrace.whatif.effects)
    effects: Mapping[str, PredictedEffect] = field(default_factory=dict)
    advice: Advice | None = None  # None: no advice computed

    def effect_of(self, finding: Finding) -> PredictedEffect | None:
        """The predicted effect of a finding's change, None where the what-if gave none."""
        return self.effects.get(finding.key)

    def recommendation_of(self, finding: Finding) -> str:
        """A finding's recommendation as the report states it: with its predicted effect."""
        effect = self.effect_of(finding)
        return finding.recommendation if effect is None else f"{finding.recommendation}; {effect.text()}"

    def sample_period_ns(self) -> float | None:
        """The GPUs' sample period: the median of each GPU's own (one series' spacing); None
        without GPU samples."""
        periods = [p for p in self.run.sample_period_ns_by_gpu if p]
        return float(np.median(periods)) if periods else None

    def summary(self) -> dict[str, Any]:
        """Run-level facts the report shows first."""
        r = self.run
        period_ns = self.sample_period_ns()
        return {
            "run": r.name, "pp_size": r.pp_size, "tp_size": r.mapping.tp_size,
            "gpus": len(r.gpu_keys), "sample_period_ms": None if period_ns is None else period_ns / 1e6,
            "grid_period_ms": r.period_ns / 1e6,
            "duration_s": float((r.grid_ns[-1] - r.grid_ns[0] + r.period_ns) / 1e9),
            "mapping_source": r.mapping.source, "log_placement": r.log_placement,
            "work_source": r.work_source, "engine_running_from": dict(r.engine_running_sources),
            "phase_source": self.phases[0].source if self.phases else None,
            "clock_offsets": r.clocks.summary(),
            "engine": r.engine.settings(),
        }


def find_phases(run: AlignedRun) -> list[Phase]:
    """Markers first, then the requests' phase labels, then levels detected from the load."""
    end = int(run.grid_ns[-1])
    phases = phases_from_markers(run.markers, end)
    if phases:
        return phases
    rq = run.requests
    if len(rq["phase"]) and any(rq["phase"]):
        return phases_from_request_labels(rq["start_ns"], rq["end_ns"], rq["phase"])
    if run.inflight is not None:
        return detect_phases(run.grid_ns, run.inflight, run.period_ns, run.inflight_counts)
    return detect_phases(run.grid_ns, engine_load(run), run.period_ns, "engine running + queued requests")


def engine_load(run: AlignedRun) -> np.ndarray:
    """Requests the engine held on the grid: its running total (reconstructed from the log, one
    micro-batch per line under SGLang's PP) plus its queue (rank 0's, never summed over stages)."""
    if not run.pp_size:
        return np.zeros(0)
    running = run.engine_running if run.engine_running is not None else run.stage_running[0]
    return np.asarray(np.nan_to_num(running) + np.nan_to_num(run.stage_queue[0]))


DEFAULT_THRESHOLDS = Thresholds()


def schedule_notes(run: AlignedRun) -> list[str]:
    """How the engine's running total was read from the log, where it matters (SGLang under PP)."""
    src = run.engine_running_sources
    lines = sum(src.values())
    if not lines or "logged" in src:
        return []
    unsure = src.get("lower bound", 0)
    text = (f"the engine's running total is each rank-0 line's micro-batch summed over one cycle of "
            f"the micro-batch slots ({lines} lines: {src.get('period', 0)} by the sizes' period, "
            f"{src.get('queue', 0)} at the admission bound with requests waiting, {src.get('busy', 0)} "
            f"from the stage's compute share, {unsure} a lower bound where equal sizes could not be "
            "told apart); log timestamps are to the second, so the cycle is read from the order")
    return [text] if run.inflight is None or unsure else []


def busy_signal_notes(metrics: list[PhaseMetrics], th: Thresholds = DEFAULT_THRESHOLDS) -> list[str]:
    """Where a stage's busy figure is SM activity because utilization.gpu read far above it: say
    so, with both figures (per phase, the stages named)."""
    notes = []
    for pm in metrics:
        spun = [st for st in pm.stages if st.busy_signal == BUSY_SIGNALS["sm_active"]
                and st.utilization_mean is not None and st.sm_active_mean is not None
                and st.utilization_mean - st.sm_active_mean > th.utilization_spin_gap]
        timed = [st for st in pm.stages if st.busy_signal in (BUSY_SIGNALS["loop_timers"],
                                                               BUSY_SIGNALS["device_timer"])]
        if timed:
            notes.append(f"{pm.label}: busy from {timed[0].busy_signal}: " + "; ".join(
                f"stage {st.pp_rank} {st.busy_signal_reason}" for st in timed))
        scheduled = [st for st in pm.stages if st.busy_signal == BUSY_SIGNALS["schedule"]]
        if scheduled:
            notes.append(f"{pm.label}: stages {', '.join(str(st.pp_rank) for st in scheduled)} take their "
                         f"busy figure from the {scheduled[0].busy_signal}: stage {scheduled[0].pp_rank}'s "
                         f"{scheduled[0].busy_signal_reason}")
        if not spun:
            continue
        util = max(st.utilization_mean or 0.0 for st in spun)
        sm = max(st.sm_active_mean or 0.0 for st in spun)
        notes.append(
            f"{pm.label}: stages {', '.join(str(st.pp_rank) for st in spun)} read utilization.gpu up to "
            f"{util:.0%} but SM activity at most {sm:.0%}: NCCL's waiting kernels (a PP rank waiting "
            "to receive) count as busy in utilization.gpu, so their busy and bubble figures use SM "
            "activity (GPM) instead")
    if any(st.busy_signal != BUSY_SIGNALS["sm_active"] for pm in metrics for st in pm.stages):
        notes.append("busy figures per stage from the best signal present, in this order: "
                     + " > ".join(BUSY_RANKING))
    return notes


def analyse_aligned(run: AlignedRun, th: Thresholds = DEFAULT_THRESHOLDS,
                    progress: Callable[[str], None] | None = None,
                    engine_series: Sequence[MetricSeries] = ()) -> Analysis:
    """Phases, metrics and findings of an aligned run; ``engine_series``, the engine's own metrics,
    give the stages' busy figures where its timers rank above the GPUs' signal."""
    series = stage_series(run)
    phases = find_phases(run)
    notes = list(run.notes)
    if not phases:
        notes.append("no phases found (no markers, labels or steady load): the whole run is one phase")
        phases = [Phase("run", int(run.grid_ns[0] - run.period_ns), int(run.grid_ns[-1]), None, "whole run")]
    metrics = []
    for ph in phases:
        if progress:
            progress(ph.label)
        pm = with_engine_timers(phase_metrics(run, series, ph), engine_series)
        pm = with_engine_counter(pm, engine_series, run.engine.engine_spec.generated_tokens_counter,
                                 run.grid_ns, run.work_ratio, run.requests)
        metrics.append(with_engine_steps(pm, engine_series, prefill_budget(run.engine)))
    if any(st.busy_signal in (BUSY_SIGNALS["loop_timers"], BUSY_SIGNALS["device_timer"])
           for pm in metrics for st in pm.stages):
        notes = [n.replace("busy and bubble fractions are not available",
                           "busy and bubble fractions from the engine's own timers") for n in notes]
    findings = diagnose(metrics, run.engine, run.pp_size, th)
    notes.extend(busy_signal_notes(metrics, th))
    notes.extend(schedule_notes(run))
    interval = run.engine.decode_log_interval
    if interval and int(interval) > 1 and not any(f.cause == "log_sampling_aliased" for f in findings):
        flag = run.engine.engine_spec.flag_for("decode_log_interval")
        notes.append(f"decode lines are logged every {int(interval)}th step ({flag}): micro-batch sizes "
                     f"are sampled; {flag} 1 (or a value coprime with the micro-batch slots) shows every "
                     "step")
    return Analysis(run, series, tuple(phases), tuple(metrics), tuple(findings), tuple(notes), th)


def capture_problem_notes(extra: Mapping[str, object]) -> list[str]:
    """One note per problem the collector had while capturing (``meta.extra["collector"]`` as
    meta.json holds it, each part narrowed before it is read): a source that delivered nothing
    for a while, a store that could not be written. A run with a gap must say so: a log path that
    did not exist gave a report with no word of it."""
    collector = extra.get("collector")
    if not isinstance(collector, dict):
        return []
    notes = []
    for p in collector.get("source_problems") or []:
        if isinstance(p, dict):
            notes.append(CaptureProblem.from_dict(p).note())
    for o in collector.get("store_outages") or []:
        if isinstance(o, dict):
            lost = f"; {o['lost_rows']} records lost at the end" if o.get("lost_rows") else ""
            notes.append(f"capture problem: the store could not be written ({o.get('error')}){lost}")
    for entry in collector.get("log_clock") or []:  # those left as logged: the analysis names them
        if isinstance(entry, dict) and (note := corrected_note(entry)) is not None:
            notes.append(note)
    dropped = collector.get("dropped_records") or {}
    if isinstance(dropped, dict) and dropped:
        notes.append("capture problem: records dropped while the store could not be written: "
                     + ", ".join(f"{n} {name}" for name, n in sorted(dropped.items())))
    return notes


def import_notes(extra: Mapping[str, object]) -> list[str]:
    """What a Prometheus import lacked (the series each missing figure could come from)."""
    if extra.get("source") != "prometheus":
        return []
    refused = [str(extra["bubble_refused"])] if extra.get("bubble_refused") else []
    lacking = extra.get("series_lacking")
    if not isinstance(lacking, list) or not lacking:
        return refused
    found = extra.get("series_found")
    return [f"Prometheus had no series for: {', '.join(map(str, lacking))} (series found: "
            f"{', '.join(map(str, found if isinstance(found, list) else []))})", *refused]


def table_notes(extra: Mapping[str, object], engine_metrics: EngineMetricColumns,
                analysis: Analysis) -> list[str]:
    """Notes from what the run holds beside the aligned streams: the engine's metrics checked
    against its log, the collector's capture problems, what a Prometheus import lacked."""
    notes = []
    if len(engine_metrics):
        notes += disagreement_notes(series_from_columns(engine_metrics.as_mapping()), analysis.metrics,
                                    analysis.run.engine.engine_spec.flag("decode_log_interval"))
    return notes + capture_problem_notes(extra) + import_notes(extra)


def store_notes(store: RunSource, analysis: Analysis) -> list[str]:
    """table_notes of a store's run."""
    return table_notes(store.meta.extra, store.read_engine_metrics(COMPARED), analysis)


def with_notes(analysis: Analysis, notes: list[str]) -> Analysis:
    """``analysis`` with ``notes`` added after its own."""
    return replace(analysis, notes=(*analysis.notes, *notes)) if notes else analysis


def analyse_tables(tables: RunTables, th: Thresholds = DEFAULT_THRESHOLDS,
                   progress: Callable[[str], None] | None = None) -> Analysis:
    """Align and diagnose a run's tables (read with the engine metrics in COMPARED)."""
    if progress:
        progress("align")
    engine_series = (series_from_columns(tables.engine_metrics.as_mapping()) if len(tables.engine_metrics)
                     else [])
    analysis = analyse_aligned(align(tables), th, progress, engine_series)
    return with_notes(analysis, table_notes(tables.meta.extra, tables.engine_metrics, analysis))
