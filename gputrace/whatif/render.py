"""`gputrace whatif`'s output: the fit's quality and, per level, measured -> predicted, as a JSON
document and as Markdown."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gputrace.engines import engine_words
from gputrace.whatif.fit import FittedModel
from gputrace.whatif.predict import PhasePrediction

SCHEMA = "gputrace.whatif/1"


def whatif_document(run: str, model: FittedModel, changes: Mapping[str, Any],
                    rows: list[PhasePrediction]) -> dict[str, Any]:
    return {"schema": SCHEMA, "run": run,
            # in the engine's own words (vLLM's max_num_seqs, not the simulator's name for it)
            "changes": {engine_words(model.params.engine).setting(k): list(v) if isinstance(v, tuple) else v
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


LATENCY_COLUMNS = (("ttft_s_p50", ".3f"), ("ttft_s_p90", ".3f"), ("itl_s_p50", ".4f"), ("itl_s_p90", ".4f"))


def _fit_row(m: Mapping[str, Any], s: Mapping[str, Any]) -> str:
    cells = [m["label"], str(m["concurrency"])]
    for key, fmt in (("throughput_tok_s", ".1f"), ("ttft_s_p50", ".3f"), ("itl_s_p50", ".4f")):
        cells.append(f"{_num(m[key], fmt)} / {_num(s[key], fmt)}")
    return "| " + " | ".join(cells) + " |"


def _prediction_row(ph: Mapping[str, Any], band: float) -> str:
    m, p = ph["measured"] or {}, ph["predicted"]
    gain = ph["gain_ratio"]
    inside = gain is not None and abs(gain) <= band
    gain_text = "n/a" if gain is None else f"{gain:+.0%}" + (" (inside the band)" if inside else "")
    tput = f"{_pair(m.get('throughput_tok_s'), p['throughput_tok_s'], '.0f')} " \
        f"(±{band * (p['throughput_tok_s'] or 0):.0f})"
    cells = [ph["label"], str(ph["concurrency"]), tput, gain_text]
    for key, fmt in LATENCY_COLUMNS:
        cells.append(_pair(m.get(key), p[key], fmt))
    cells.append(f"{_bubbles(tuple(m.get('bubble_fraction_by_stage') or ()))} -> "
                 f"{_bubbles(tuple(p['bubble_fraction_by_stage']))}")
    return "| " + " | ".join(cells) + " |"


def render_markdown(doc: Mapping[str, Any]) -> str:
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


def render_advice_markdown(doc: Mapping[str, Any]) -> str:
    """`whatif --search`: the advice's sentence, per phase measured -> predicted, the alternatives."""
    out = [f"# Advice: {doc['run']}", "", doc["sentence"], "",
           f"objective: {doc['objective']}" + (f" (SLO {doc['slo']})" if doc.get("slo") else "")
           + f"; {doc['candidates']} change sets replayed", "",
           "| phase | measured tok/s | model as run tok/s | predicted tok/s | gain | band | TTFT p90 s "
           "| ITL p90 s |", "|---|---|---|---|---|---|---|---|"]
    for p in doc["phases"]:
        out.append(f"| {p['phase']} | {_num(p['measured_tok_s'], '.0f')} "
                   f"| {_num(p['unchanged_tok_s'], '.0f')} | {_num(p['predicted_tok_s'], '.0f')} "
                   f"| {p['gain_ratio']:+.0%} | ±{p['band_ratio']:.0%} "
                   f"| {_num(p['ttft_s_p90'], '.3f')} | {_num(p['itl_s_p90'], '.4f')} |")
    notes = [f"- alternative: {a['text']}" for a in doc["alternatives"]]
    notes += [f"- {x}" for x in sorted({p["extrapolation"] for p in doc["phases"] if p.get("extrapolation")})]
    return "\n".join(out + (["", *notes] if notes else [])) + "\n"
