"""``analyse_run``: the one way to analyse a run, for every command that does (report, compare,
whatif, export) and the demo. Its result, an immutable ``Analysis``, is what every output renders.

The steps, each producing a new ``Analysis`` beside the last (none edits a finding):
align -> phases, metrics, findings -> the run's own notes (the engine's metrics against its log,
capture problems, what an import lacked) -> the what-if's predicted effect of each finding's
change (``Analysis.effects``) -> the advice (``Analysis.advice``, from the ``advise`` hook).

The run is read through ``RunSource`` (an opened ``Store``): the reading is the caller's, the
analysis is pure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from gputrace.analysis.aligned_run import AlignedRun, align_store
from gputrace.analysis.diagnose import Thresholds
from gputrace.analysis.engine_metrics import COMPARED, series_from_columns
from gputrace.analysis.result import (
    DEFAULT_THRESHOLDS,
    Advice,
    Analysis,
    analyse_aligned,
    store_notes,
    with_notes,
)
from gputrace.run_tables import RunSource, Window
from gputrace.whatif.effects import with_predicted_effects
from gputrace.whatif.fit import FittedModel
from gputrace.whatif.replay import replay_session


class Advise(Protocol):
    """The advisor's hook: from the finished analysis (findings, effects, notes) and the what-if
    model already fitted for the effects (None where none was: fit one if needed), the advice for
    the deployment, or None for none. Called once per analysis, last."""

    def __call__(self, analysis: Analysis, model: FittedModel | None, /) -> Advice | None: ...


def analyse_run(source: RunSource, window: Window = (None, None), *, advise: Advise | None = None,
                effects: bool = True, thresholds: Thresholds = DEFAULT_THRESHOLDS,
                aligned: AlignedRun | None = None,
                progress: Callable[[str], None] | None = None) -> Analysis:
    """Analyse ``source`` (within ``window``, collector clock; None: open).

    ``effects``: fit the what-if model and predict each finding's change (seconds; the findings
    are then ranked by the predicted gain). ``advise``: the advice hook (see ``Advise``); None:
    no advice. ``aligned``: the run already aligned from this source and window (the report
    aligns first to size its progress bar). ``progress`` is called with each step's name.
    """
    if aligned is None:
        aligned = align_store(source, window)
    # the engine's own metrics (SGLang's stage timers rank above the GPUs' busy signal)
    engine_columns = source.read_engine_metrics(COMPARED)
    engine_series = series_from_columns(engine_columns.as_mapping()) if len(engine_columns) else []
    analysis = analyse_aligned(aligned, thresholds, progress, engine_series)
    analysis = with_notes(analysis, store_notes(source, analysis))
    model: FittedModel | None = None
    # the fit, the findings' effects and the advice's search share their replays (one session)
    with replay_session():
        if effects:
            analysis, model = with_predicted_effects(analysis, progress)
        if advise is not None:
            if progress:
                progress("advice")
            analysis = replace(analysis, advice=advise(analysis, model))
    return analysis
