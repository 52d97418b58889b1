"""Predicted against measured, for `gputrace compare A B` where B changed A's deployment: the
simulator fitted to A, run under the settings B's log states differently (the change a finding of
A recommended, or any other the model can make), against what B measured, per matching phase."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypedDict

from gputrace.analysis.diagnose import engine_kind
from gputrace.analysis.result import Analysis
from gputrace.engines import engine_words
from gputrace.errors import GputraceError
from gputrace.vocabulary import Cause
from gputrace.whatif.fit import FittedModel, deployment_params, fit_model
from gputrace.whatif.outcome import measured_outcomes, relative_error
from gputrace.whatif.param_change import ParamChange, ParamJson, ParamValue, param_json
from gputrace.whatif.predict import CHANGEABLE, finding_change, predict

SCHEMA_KEY = "predicted_against_measured"


class RecommendedBy(TypedDict):
    """A finding of A whose recommendation B's deployment made."""

    cause: Cause
    phase: str
    recommendation: str


class PhaseAgainst(TypedDict):
    """One phase both runs had: A measured, predicted for B's settings, B measured."""

    label: str
    concurrency: int
    measured_a_tok_s: float | None
    predicted_tok_s: float | None
    measured_b_tok_s: float | None
    error: float | None  # predicted / B measured - 1
    within_band: bool | None


class PredictedAgainstMeasured(TypedDict):
    """compare.json's ``predicted_against_measured``."""

    changes: dict[str, list[ParamJson]]  # setting -> [A's, B's]
    recommended_by: list[RecommendedBy]
    band_ratio: float | None
    phases: list[PhaseAgainst]
    note: str | None


def applied_changes(a: Analysis, b: Analysis) -> dict[str, tuple[ParamValue, ParamValue]]:
    """The settings a what-if may change that B's log states otherwise than A's, as (A's value,
    B's value) under the simulator's names; a setting either log leaves unstated is not compared."""
    da = deployment_params(a.run.engine, a.run.pp_size)
    db = deployment_params(b.run.engine, b.run.pp_size)
    if engine_words(engine_kind(a.run.engine)).microbatch_slots:  # a log without K ran the engine's default K
        da.setdefault("pp_max_micro_batch_size", None)
        db.setdefault("pp_max_micro_batch_size", None)
    return {k: (da[k], db[k]) for k in CHANGEABLE if k in da and k in db and da[k] != db[k]}


def _recommended_by(a: Analysis, model: FittedModel, changes: ParamChange) -> list[RecommendedBy]:
    """A's findings whose recommendation is (part of) ``changes``."""
    out: list[RecommendedBy] = []
    for f in a.findings:
        change = finding_change(model, f.change, f.phase) if f.change is not None else None
        if change and all(changes.get(k) == v for k, v in change.items()):
            out.append({"cause": f.cause, "phase": f.phase, "recommendation": f.recommendation})
    return out


def predicted_against_measured(a: Analysis, b: Analysis, progress: Callable[[str], None] | None = None
                               ) -> PredictedAgainstMeasured:
    """The section of the comparison: ``changes`` (setting -> [A's, B's]; empty where B's log
    states the same settings), the findings of A that recommended them, and per phase A
    measured, predicted and B measured; ``note`` says why there is no prediction where there is
    none."""
    out: PredictedAgainstMeasured = {"changes": {}, "recommended_by": [], "band_ratio": None, "phases": [],
                                     "note": None}
    if engine_kind(a.run.engine) != engine_kind(b.run.engine) or a.run.pp_size != b.run.pp_size:
        out["note"] = ("the runs are of different engines or pipeline depths: no prediction of one "
                       "from the other")
        return out
    applied = applied_changes(a, b)
    changes = {k: vb for k, (_, vb) in applied.items()}
    out["changes"] = {k: [param_json(va), param_json(vb)] for k, (va, vb) in applied.items()}
    if not changes:
        out["note"] = ("B's log states the same deployment settings as A's (of those a what-if can "
                       "change): nothing to predict")
        return out
    if progress is not None:
        progress("fitting the simulator to run A for its prediction of B ...")
    try:
        model = fit_model(a)
        rows = predict(model, changes)
    except GputraceError as exc:
        out["note"] = f"no prediction: the what-if model could not be fitted to run A ({exc})"
        return out
    measured_b = {m.label: m for m in measured_outcomes(b)}
    out["recommended_by"] = _recommended_by(a, model, changes)
    out["band_ratio"] = round(model.uncertainty_ratio, 4)
    for row in rows:
        mb = measured_b.get(row.label)
        if row.measured is None or mb is None:
            continue
        error = relative_error(row.predicted.throughput_tok_s, mb.throughput_tok_s)
        out["phases"].append({
            "label": row.label, "concurrency": row.concurrency,
            "measured_a_tok_s": row.measured.throughput_tok_s,
            "predicted_tok_s": row.predicted.throughput_tok_s,
            "measured_b_tok_s": mb.throughput_tok_s,
            "error": None if error is None else round(error, 4),
            "within_band": None if error is None else bool(abs(error) <= model.uncertainty_ratio)})
    return out
