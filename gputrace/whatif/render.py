"""`gputrace whatif`'s output: the fit's quality and, per level, measured -> predicted, as a JSON
document and as Markdown."""

from __future__ import annotations

from typing import Literal, TypedDict

from gputrace.analysis.predicted import cannot_predict, predictable
from gputrace.engines import engine_words
from gputrace.whatif.advise import AdviceRow
from gputrace.whatif.fit import FittedModel
from gputrace.whatif.outcome import PhaseOutcomeRow
from gputrace.whatif.param_change import ParamChange, ParamJson, param_json
from gputrace.whatif.prediction import PhasePrediction, PhasePredictionRow, decision_band

SCHEMA = "gputrace.whatif/1"


class FitPhaseRow(TypedDict):
    """One captured phase: as measured, and as the fitted model replays it."""

    measured: PhaseOutcomeRow
    simulated: PhaseOutcomeRow


class FitRow(TypedDict):
    """The fit's quality: its band, its scale factors, its notes, per phase."""

    uncertainty_ratio: float
    scale: dict[str, float]
    notes: list[str]
    phases: list[FitPhaseRow]


class WhatifDocument(TypedDict):
    """whatif.json: the changes (in the engine's words), the fit, per phase the prediction."""

    schema: str
    run: str
    changes: dict[str, ParamJson]
    fit: FitRow
    phases: list[PhasePredictionRow]


def whatif_document(run: str, model: FittedModel, changes: ParamChange,
                    rows: list[PhasePrediction]) -> WhatifDocument:
    return {"schema": SCHEMA, "run": run,
            # in the engine's own words (vLLM's max_num_seqs, not the simulator's name for it)
            "changes": {engine_words(model.params.engine).setting(k): param_json(v)
                        for k, v in changes.items()},
            "fit": {"uncertainty_ratio": round(model.uncertainty_ratio, 4), "scale": model.scale,
                    "notes": model.notes,
                    "phases": [{"measured": m.to_dict(), "simulated": s.to_dict()}
                               for m, s in zip(model.measured, model.simulated, strict=True)]},
            "phases": [r.to_dict() for r in rows]}


def _num(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def _pair(m: float | None, p: float | None, fmt: str) -> str:
    return f"{_num(m, fmt)} -> {_num(p, fmt)}"


def _bubbles(values: tuple[float | None, ...]) -> str:
    return " ".join(_num(v, ".2f") for v in values) or "n/a"


Figure = Literal["throughput_tok_s", "ttft_s_p50", "ttft_s_p90", "itl_s_p50", "itl_s_p90"]
LATENCY_COLUMNS: tuple[tuple[Figure, str], ...] = (
    ("ttft_s_p50", ".3f"), ("ttft_s_p90", ".3f"), ("itl_s_p50", ".4f"), ("itl_s_p90", ".4f"))
FIT_COLUMNS: tuple[tuple[Figure, str], ...] = (
    ("throughput_tok_s", ".1f"), ("ttft_s_p50", ".3f"), ("itl_s_p50", ".4f"))


def _fit_row(m: PhaseOutcomeRow, s: PhaseOutcomeRow) -> str:
    cells = [m["label"], str(m["concurrency"])]
    for key, fmt in FIT_COLUMNS:
        cells.append(f"{_num(m[key], fmt)} / {_num(s[key], fmt)}")
    return "| " + " | ".join(cells) + " |"


def _prediction_row(ph: PhasePredictionRow, band: float) -> str:
    m, p = ph["measured"], ph["predicted"]
    gain = ph["gain_ratio"]
    inside = gain is not None and abs(gain) <= band
    gain_text = "n/a" if gain is None else f"{gain:+.0%}" + (" (inside the band)" if inside else "")
    tput = f"{_pair(m['throughput_tok_s'] if m else None, p['throughput_tok_s'], '.0f')} " \
        f"(±{band * (p['throughput_tok_s'] or 0):.0f})"
    if not predictable(band):
        gain_text, tput = cannot_predict(band), _num(m["throughput_tok_s"] if m else None, ".0f")
    cells = [ph["label"], str(ph["concurrency"]), tput, gain_text]
    for key, fmt in LATENCY_COLUMNS:
        cells.append(_pair(m[key] if m else None, p[key], fmt))
    cells.append(f"{_bubbles(tuple(m['bubble_fraction_by_stage'] if m else ()))} -> "
                 f"{_bubbles(tuple(p['bubble_fraction_by_stage']))}")
    return "| " + " | ".join(cells) + " |"


def render_markdown(doc: WhatifDocument) -> str:
    changes = ", ".join(f"{k}={v}" for k, v in doc["changes"].items()) or "none (the fitted model as is)"
    band = doc["fit"]["uncertainty_ratio"]
    out = [f"# What if: {doc['run']}", "", f"change: {changes}", "",
           "## The fit (measured / simulated at the captured setting)", "",
           "| phase | C | tok/s | TTFT p50 s | ITL p50 s |", "|---|---|---|---|---|"]
    out += [_fit_row(ph["measured"], ph["simulated"]) for ph in doc["fit"]["phases"]]
    out += ["", f"Predictions carry ±{band:.0%} (the fit's RMS throughput residual, at least the "
            "simulator's seed-to-seed spread).", *[f"- {n}" for n in doc["fit"]["notes"]], "",
            "## Measured -> predicted", "",
            "| phase | C | tok/s | gain | TTFT p50 s | TTFT p90 s | ITL p50 s | ITL p90 s "
            "| bubble by stage |",
            "|---|---|---|---|---|---|---|---|---|"]
    out += [_prediction_row(ph, band) for ph in doc["phases"]]
    return "\n".join(out) + "\n"


def render_advice_markdown(run: str, doc: AdviceRow) -> str:
    """`whatif --search`: the advice's sentence, per phase measured -> predicted, the alternatives."""
    out = [f"# Advice: {run}", "", doc["sentence"], "",
           f"objective: {doc['objective']}" + (f" (SLO {doc['slo']})" if doc["slo"] else "")
           + f"; {doc['candidates']} change sets replayed", "",
           "| phase | measured tok/s | model as run tok/s | predicted tok/s | gain | band | TTFT p90 s "
           "| ITL p90 s |", "|---|---|---|---|---|---|---|---|"]
    for p in doc["phases"]:
        stated = predictable(decision_band(p["band_ratio"], p["model_band_ratio"]))
        out.append(f"| {p['phase']} | {_num(p['measured_tok_s'], '.0f')} "
                   f"| {_num(p['unchanged_tok_s'], '.0f')} "
                   f"| {_num(p['predicted_tok_s'], '.0f') if stated else 'cannot predict'} "
                   f"| {format(p['gain_ratio'], '+.0%') if stated else 'cannot predict'} "
                   f"| ±{p['band_ratio']:.0%} "
                   f"| {_num(p['ttft_s_p90'], '.3f')} | {_num(p['itl_s_p90'], '.4f')} |")
    notes = [f"- alternative: {a['text']}" for a in doc["alternatives"]]
    notes += [f"- {x}" for x in sorted({p["extrapolation"] for p in doc["phases"] if p["extrapolation"]})]
    return "\n".join(out + (["", *notes] if notes else [])) + "\n"
