"""Each finding's recommendation with its predicted effect: the fitted model run under the change
the finding names (its details' knob and value), the gain at its phase, the cost at the others,
and the findings ranked by the net gain over the run's levels. diagnose's rules are untouched:
this runs after them, inside ``report``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from gputrace.analysis.diagnose import Finding, changes_the_deployment
from gputrace.analysis.run import Analysis
from gputrace.errors import GputraceError
from gputrace.whatif.fit import FittedModel, fit_model
from gputrace.whatif.predict import PhasePrediction, finding_change, predict

MAX_CHANGES = 4  # distinct changes simulated per report: one replay of the run each (bounded time)


def _effect(f: Finding, rows: list[PhasePrediction], unchanged: dict[str, float | None]
            ) -> dict[str, Any] | None:
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
    others: list[dict[str, Any]] = []
    for r in rows:
        if r is at or r.measured is None or r.measured.throughput_tok_s is None \
                or r.predicted.throughput_tok_s is None:
            continue
        others.append({"phase": r.label, "concurrency": r.concurrency,
                       "measured_tok_s": round(r.measured.throughput_tok_s, 1),
                       "predicted_tok_s": round(r.predicted.throughput_tok_s, 1),
                       "unchanged_tok_s": base(r)})
    gain_here = at.predicted.throughput_tok_s - at.measured.throughput_tok_s
    net = sum(o["predicted_tok_s"] - o["measured_tok_s"] for o in others) + gain_here
    return {"phase": f.phase, "concurrency": at.concurrency,
            "measured_tok_s": round(at.measured.throughput_tok_s, 1),
            "predicted_tok_s": round(at.predicted.throughput_tok_s, 1), "unchanged_tok_s": base(at),
            "band_ratio": round(band, 4), "gain_ratio": round(at.gain_ratio, 4),
            "within_uncertainty": abs(at.gain_ratio) <= band,
            "net_gain_tok_s": round(net, 1), "other_phases": others}


def effect_text(e: dict[str, Any]) -> str:
    """``predicted: 248 -> 312 tok/s at C=32 (±8 %)``, the levels it costs, and a gain the model
    cannot tell from none."""
    # levels, not phase labels: a label is the run's text, the recommendation goes in a code span
    text = (f"predicted: {e['measured_tok_s']:.0f} -> {e['predicted_tok_s']:.0f} tok/s at "
            f"C={e['concurrency']} (±{e['band_ratio']:.0%})")
    band = e["band_ratio"]
    if e["within_uncertainty"]:
        text += ", inside the model's uncertainty: no clear gain"
    elif e.get("unchanged_tok_s") and not _moves(e, band, up=True):
        # measured -> predicted is then the fit's offset from the run, not the change's effect
        text += (f"; the model gives {e['unchanged_tok_s']:.0f} tok/s there unchanged: no clear gain "
                 "from the change itself")
    costs = [f"C={o['concurrency']} {o['measured_tok_s']:.0f} -> {o['predicted_tok_s']:.0f}"
             for o in e["other_phases"] if _moves(o, band, up=False)]
    if costs:
        text += "; costs " + ", ".join(costs) + " tok/s"
    return text


def _moves(e: dict[str, Any], band: float, up: bool) -> bool:
    """Whether the change moves a phase past its band, up or down. A prediction is calibrated
    (measured x model(change) / model(as run)), so against the measurement it is what the change
    itself moves, not the fit's offset from the run."""
    reference = e["measured_tok_s"]
    if not reference:
        return False
    moved = float(e["predicted_tok_s"]) / float(reference) - 1
    return moved > band if up else moved < -band


def rank_by_gain(findings: list[Finding]) -> list[Finding]:
    """Predicted gains first (largest net gain over the levels first), then the findings the
    model cannot weigh in their order, then predicted losses; "cannot tell" stays last."""
    def net(f: Finding) -> float:
        return float(f.details["predicted"]["net_gain_tok_s"])

    causes = [f for f in findings if f.cause != "cannot_tell"]
    # a finding about the offered load ("offer at least 8 requests") is a fact about the load,
    # never ranked as a gain of the configuration
    gains = sorted((f for f in causes if "predicted" in f.details and net(f) > 0
                    and changes_the_deployment(f.details.get("knob"))), key=lambda f: -net(f))
    losses = sorted((f for f in causes if "predicted" in f.details and net(f) <= 0), key=lambda f: -net(f))
    rest = [f for f in causes if "predicted" not in f.details or (f not in gains and net(f) > 0)]
    return gains + rest + losses + [f for f in findings if f.cause == "cannot_tell"]


def add_predicted_effects(analysis: Analysis, progress: Callable[[str], None] | None = None,
                          model: FittedModel | None = None,
                          predictions: Mapping[str, list[PhasePrediction]] | None = None
                          ) -> FittedModel | None:
    """Fit the model to ``analysis`` (or take ``model``, already fitted and noted), give each
    finding it can weigh ``details["predicted"]`` and the text on its recommendation, rank the
    findings, and note the fit's quality. ``predictions`` (change key -> rows, the advice's
    search) are reused rather than replayed again. None where no finding names a change the
    model can make (nothing is fitted then)."""
    wanted = [f for f in analysis.findings if f.cause != "cannot_tell" and f.details.get("knob")]
    if not wanted or not any(pm.throughput_tok_s for pm in analysis.metrics):
        return None
    if model is None:
        if progress:
            progress("what-if fit")
        try:
            model = fit_model(analysis)
        except GputraceError as exc:  # the report stands without predictions; say why they are missing
            analysis.notes.append(f"no predicted effects: the what-if model could not be fitted to this "
                                  f"run ({exc})")
            return None
        analysis.notes.append(fit_note(model))
    unchanged = {m.label: model.unchanged_tok_s(m.label) for m in model.measured}
    runs: dict[str, list[PhasePrediction]] = dict(predictions or {})
    for f in wanted:
        change = finding_change(model, f.to_dict())
        if change is None:
            continue
        key = repr(sorted(change.items()))
        if key not in runs:
            if len(runs) >= MAX_CHANGES + len(predictions or {}):
                continue
            runs[key] = predict(model, change)
        effect = _effect(f, runs[key], unchanged)
        if effect is not None:
            f.details["predicted"] = effect
            f.recommendation += f"; {effect_text(effect)}"
    analysis.findings[:] = rank_by_gain(analysis.findings)
    return model


def fit_note(model: FittedModel) -> str:
    """One line: the what-if model's throughput against the measured one, per phase."""
    parts = []
    for row in model.quality_rows():
        measured, simulated = row["throughput_tok_s"]
        if measured is not None and simulated is not None:
            parts.append(f"{row['phase']} {measured:.0f}/{simulated:.0f}")
    text = ("what-if model (the simulator fitted to this run) replays it at measured/simulated tok/s "
            f"{', '.join(parts)}; predictions carry ±{model.uncertainty_ratio:.0%} (wider where a change "
            "runs micro-batches past those the run ran), as measured x model(change) / model(as run)")
    if model.correction:
        text += "; corrected per phase " + ", ".join(f"{k} x{v:.2f}" for k, v in model.correction.items())
    return text
