"""Each finding's predicted effect: the fitted model run under the change the finding names (its
``Change``), the gain at its phase, the cost at the others, and the findings ranked
by the net gain over the run's levels. The effects are data beside the findings
(``Analysis.effects``); the findings themselves are untouched."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from gputrace.analysis.diagnose import Finding
from gputrace.analysis.predicted import PhaseEffect, PredictedEffect
from gputrace.analysis.result import Analysis, with_notes
from gputrace.errors import GputraceError
from gputrace.whatif.fit import FittedModel, fit_model, replay_note
from gputrace.whatif.predict import finding_change, predict
from gputrace.whatif.prediction import PhasePrediction

MAX_CHANGES = 4  # distinct changes simulated per report: one replay of the run each (bounded time)


def _effect(f: Finding, rows: list[PhasePrediction], unchanged: dict[str, float | None]
            ) -> PredictedEffect | None:
    """The change's effect at the finding's phase and the others; ``unchanged`` is the model's
    replay of the run as it ran (phase label -> tok/s), what the change itself moves."""
    def base(r: PhasePrediction) -> float | None:
        value = unchanged.get(r.measured.label) if r.measured else None
        return None if value is None else round(value, 1)

    at = next((r for r in rows if r.label == f.phase), None)
    if at is None or at.measured is None or at.gain_ratio is None:
        return None
    assert at.measured.throughput_tok_s is not None and at.predicted.throughput_tok_s is not None
    band = at.band_ratio
    others: list[PhaseEffect] = []
    for r in rows:
        if r is at or r.measured is None or r.measured.throughput_tok_s is None \
                or r.predicted.throughput_tok_s is None:
            continue
        others.append(PhaseEffect(r.label, r.concurrency, round(r.measured.throughput_tok_s, 1),
                                  round(r.predicted.throughput_tok_s, 1), base(r)))
    gain_here = at.predicted.throughput_tok_s - at.measured.throughput_tok_s
    net = sum(o.predicted_tok_s - o.measured_tok_s for o in others) + gain_here
    return PredictedEffect(
        f.phase, at.concurrency, round(at.measured.throughput_tok_s, 1),
        round(at.predicted.throughput_tok_s, 1), base(at), round(band, 4), round(at.gain_ratio, 4),
        abs(at.gain_ratio) <= at.decision_band_ratio, round(net, 1), tuple(others))


def rank_by_gain(findings: Sequence[Finding], effects: Mapping[str, PredictedEffect]) -> list[Finding]:
    """The deployment's findings first: predicted gains (largest net gain over the levels first),
    then those the model cannot weigh in their order, then predicted losses; then the findings
    about the offered load ("offer at least 8 requests": a fact about the load, never ranked as a
    gain of the configuration); "cannot tell" last."""
    def net(f: Finding) -> float:
        return effects[f.key].net_gain_tok_s

    causes = [f for f in findings if f.cause != "cannot_tell"]
    load = [f for f in causes if f.change is not None and not f.change.changes_the_deployment]
    deployment = [f for f in causes if f not in load]
    gains = sorted((f for f in deployment if f.key in effects and net(f) > 0), key=lambda f: -net(f))
    losses = sorted((f for f in deployment if f.key in effects and net(f) <= 0), key=lambda f: -net(f))
    rest = [f for f in deployment if f.key not in effects]
    return gains + rest + losses + load + [f for f in findings if f.cause == "cannot_tell"]


def with_predicted_effects(analysis: Analysis, progress: Callable[[str], None] | None = None
                           ) -> tuple[Analysis, FittedModel | None]:
    """``analysis`` with the predicted effect of each finding it can weigh (``effects``), its
    findings ranked by them and the fit's quality noted; and the model fitted (None where no
    finding names a change the model can make: nothing is fitted then)."""
    wanted = [f for f in analysis.findings if f.cause != "cannot_tell" and f.change is not None]
    if not wanted or not any(pm.throughput_tok_s for pm in analysis.metrics):
        return analysis, None
    if progress:
        progress("what-if fit")
    try:
        model = fit_model(analysis)
    except GputraceError as exc:  # the report stands without predictions; say why they are missing
        return with_notes(analysis, [f"no predicted effects: the what-if model could not be fitted "
                                     f"to this run ({exc})"]), None
    unchanged = {m.label: model.unchanged_tok_s(m.label) for m in model.measured}
    runs: dict[str, list[PhasePrediction]] = {}
    effects: dict[str, PredictedEffect] = {}
    for f in wanted:
        change = finding_change(model, f.change, f.phase) if f.change is not None else None
        if change is None:
            continue
        key = repr(sorted(change.items()))
        if key not in runs:
            if len(runs) >= MAX_CHANGES:
                continue
            runs[key] = predict(model, change)
        effect = _effect(f, runs[key], unchanged)
        if effect is not None:
            effects[f.key] = effect
    ranked = rank_by_gain(analysis.findings, effects)
    return replace(analysis, findings=tuple(ranked), effects=effects,
                   notes=(*analysis.notes, fit_note(model))), model


def fit_note(model: FittedModel) -> str:
    """One line: the what-if model's throughput against the measured one, per phase."""
    parts = []
    for row in model.quality_rows():
        measured, simulated = row.throughput_tok_s
        if measured is not None and simulated is not None:
            parts.append(f"{row.phase} {measured:.0f}/{simulated:.0f}")
    text = ("what-if model (the simulator fitted to this run) replays it at measured/simulated tok/s "
            f"{', '.join(parts)}; predictions carry ±{model.uncertainty_ratio:.0%} (wider where a change "
            "runs micro-batches past those the run ran), as measured x model(change) / model(as run)")
    if (reduced := replay_note(model.params)) is not None:
        text += "; " + reduced
    if model.correction:
        text += "; corrected per phase " + ", ".join(f"{k} x{v:.2f}" for k, v in model.correction.items())
    return text
