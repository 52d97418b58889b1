"""Each stage's busy share over time by the signal the analysis took for it in each phase (the
busy-signal ranking, ``phase_figures.BUSY_RANKING``), so a figure over time shows what the verdict
rests on rather than raw NVML utilization, which reads busy while a stage waits in NCCL."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gputrace.analysis.aligned_run import AlignedRun
from gputrace.analysis.phase_figures import (
    BUSY_SIGNALS,
    PhaseMetrics,
    StageMetrics,
    StageSeries,
    cell_weights,
)

# Signals whose figure is a whole phase's, not a series on the grid: the schedule (micro-batches
# in flight / stages, shared out by power) and the engine's timers (counter rises over the phase).
PHASE_FIGURE_SIGNALS = frozenset({BUSY_SIGNALS["schedule"], BUSY_SIGNALS["device_timer"],
                                  BUSY_SIGNALS["loop_timers"]})


@dataclass(frozen=True)
class BusyOverTime:
    """``busy`` (pp x grid cells): each stage's busy share per cell by the phase's signal; NaN
    where there is no figure (no sample, outside every phase). ``signals``: per stage, the
    signals its cells came from, in the order the phases first used them."""

    busy: np.ndarray
    signals: tuple[tuple[str, ...], ...]


def stage_busy_row(series: StageSeries, stage: int, st: StageMetrics, work: np.ndarray, w: np.ndarray,
                   cells: slice) -> np.ndarray:
    """One stage's busy share on one phase's cells, whose weighted mean (weights ``w``, NaN cells
    left out, as the analysis averages) is the stage's busy figure. A phase figure (schedule,
    engine timer) is spread over the cells in proportion to the engine's work: kernels run only
    while there is a request, so idle cells stay idle."""
    n = len(w)
    if st.busy_signal == BUSY_SIGNALS["sm_active"]:
        return np.asarray(series.sm_active[stage, cells], dtype=np.float64)
    if st.busy_signal == BUSY_SIGNALS["utilization"]:
        return np.asarray(series.utilization[stage, cells], dtype=np.float64)
    if st.busy_signal not in PHASE_FIGURE_SIGNALS or st.busy_fraction is None:
        return np.full(n, np.nan)
    work = np.nan_to_num(np.asarray(work, dtype=np.float64))
    work_mean = float(np.sum(work * w) / np.sum(w)) if np.sum(w) > 0 else 0.0
    if work_mean <= 0:
        return np.full(n, st.busy_fraction)  # no work on the grid: the figure as it is
    return work * (st.busy_fraction / work_mean)


def busy_over_time(run: AlignedRun, series: StageSeries, metrics: Sequence[PhaseMetrics]) -> BusyOverTime:
    """Every stage's busy share on the whole grid, phase by phase (a cell two phases share takes
    the later phase's figure)."""
    pp = run.pp_size
    busy = np.full((pp, len(run.grid_ns)), np.nan)
    signals: list[list[str]] = [[] for _ in range(pp)]
    for pm in metrics:
        cells, w = cell_weights(run.grid_ns, run.period_ns, pm.start_ns, pm.end_ns)
        work = run.work_ratio[cells]
        for st in pm.stages:
            row = stage_busy_row(series, st.pp_rank, st, work, w, cells)
            busy[st.pp_rank, cells] = np.where(w > 0, row, busy[st.pp_rank, cells])
            if st.busy_fraction is not None and st.busy_signal not in signals[st.pp_rank]:
                signals[st.pp_rank].append(st.busy_signal)
    return BusyOverTime(busy, tuple(tuple(s) for s in signals))
