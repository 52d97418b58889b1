"""Run A against run B per matching phase (by label): throughput, bubble fraction per stage, and
which findings the change resolved or introduced."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gputrace.analysis.diagnose import Finding
from gputrace.analysis.result import Analysis

SCHEMA = "gputrace.compare/1"
SAME_WITHIN = 0.05  # a throughput ratio this close to 1 is "the same" (the runs' own noise is about this)


@dataclass(frozen=True, slots=True)
class RunRef:
    """Where a compared run came from: its directory, its identity (meta.json's name and creation
    time: a copied directory keeps it) and the window of it analysed (collector clock, None: open)."""

    dir: str
    run_id: str
    window_ns: tuple[int | None, int | None] = (None, None)


def _causes(a: Analysis, phase: str) -> set[str]:
    return {f.cause for f in a.findings if f.phase == phase}


def _ratio(b: float | None, a: float | None) -> float | None:
    return b / a if a and b is not None else None


def _mean(values: list[float | None]) -> float | None:
    held = [v for v in values if v is not None]
    return float(np.mean(held)) if held else None


def _finding(f: Finding) -> dict[str, Any]:
    return {"cause": f.cause, "phase": f.phase, "summary": f.summary, "recommendation": f.recommendation}


def top_finding(a: Analysis) -> dict[str, Any] | None:
    """The finding the run's report leads its verdict with: the first that names a cause and a
    change to the deployment, else the first that names a cause; None without one."""
    causes = [f for f in a.findings if f.cause != "cannot_tell"]
    top = next((f for f in causes if f.change is not None and f.change.changes_the_deployment), None)
    top = top or (causes[0] if causes else None)
    return None if top is None else _finding(top)


def phase_verdict(gain: float | None) -> str | None:
    """B against A in one phase: "better", "worse", "same" (within SAME_WITHIN), None without a gain."""
    if gain is None:
        return None
    return "better" if gain > 1 + SAME_WITHIN else "worse" if gain < 1 - SAME_WITHIN else "same"


def _where_phases(phases: list[dict[str, Any]], chosen: list[dict[str, Any]]) -> str:
    """Where in the sweep ``chosen`` lie: "C<=32" when they are its lowest levels, "C>=64" its
    highest, else their labels."""
    levels = [p["target_concurrency"] for p in phases]
    if len(chosen) > 1 and None not in levels:
        ordered = sorted(phases, key=lambda p: p["target_concurrency"])
        n = len(chosen)
        if {id(p) for p in ordered[:n]} == {id(p) for p in chosen}:
            return f"C<={ordered[n - 1]['target_concurrency']}"
        if {id(p) for p in ordered[-n:]} == {id(p) for p in chosen}:
            return f"C>={ordered[-n]['target_concurrency']}"
    return ", ".join(p["label"] for p in chosen)


def _amount(chosen: list[dict[str, Any]]) -> str:
    pcts = sorted(round(abs(p["throughput_gain"] - 1) * 100) for p in chosen)
    return f"{pcts[0]} %" if pcts[0] == pcts[-1] else f"{pcts[0]}-{pcts[-1]} %"


def bottom_line(phases: list[dict[str, Any]]) -> dict[str, Any]:
    """The comparison in one sentence: better, worse or a trade-off, and at the peak load (the
    phase of the highest concurrency in both runs) whether to keep B or revert."""
    judged = [p for p in phases if p["verdict"] is not None]
    if not judged:
        return {"verdict": None, "text": "No phase with throughput in both runs: nothing to judge."}
    peak = max(judged, key=lambda p: (p["target_concurrency"] or 0, judged.index(p)))
    better = [p for p in judged if p["verdict"] == "better"]
    worse = [p for p in judged if p["verdict"] == "worse"]
    gains = f"gains {_amount(better)} at {_where_phases(judged, better)}" if better else ""
    losses = f"loses {_amount(worse)} at {_where_phases(judged, worse)}" if worse else ""
    if better and worse:
        verdict = "trade-off"
        action = "keep it" if peak["verdict"] == "better" else "revert" if peak["verdict"] == "worse" else \
            "it does not matter there"
        text = (f"Trade-off: B {gains} and {losses}; at your peak load ({peak['label']}) B is "
                f"{peak['verdict']}: {action}.")
    elif worse:
        verdict = "worse"
        where = "at your peak load" if peak["verdict"] == "worse" else "below your peak load"
        text = f"B is worse {where}: revert. B {losses}; no phase better."
    elif better:
        verdict = "better"
        text = f"B is better: keep it. B {gains}; no phase worse."
    else:
        verdict = "same"
        text = (f"B is the same as A (within {SAME_WITHIN:.0%} in every phase): the change did not move "
                "throughput.")
    return {"verdict": verdict, "peak_phase": peak["label"], "text": text}


def _described(run: Analysis, phase: str, causes: set[str]) -> list[dict[str, Any]]:
    """The findings of ``causes`` in ``phase`` as that run states them."""
    return [_finding(f) for f in run.findings if f.phase == phase and f.cause in causes]


def same_run(ref_a: RunRef | None, ref_b: RunRef | None) -> str | None:
    """Why A and B are one run (the same directory, or a copy with the same id), else None."""
    if ref_a is None or ref_b is None:
        return None
    if Path(ref_a.dir).resolve() == Path(ref_b.dir).resolve():
        why = "the same run directory"
    elif ref_a.run_id == ref_b.run_id:
        why = f"the same run id ({ref_a.run_id})"
    else:
        return None
    if ref_a.window_ns != ref_b.window_ns:
        return f"{why}, in different windows"
    return why


def compare_analyses(a: Analysis, b: Analysis, ref_a: RunRef | None = None,
                     ref_b: RunRef | None = None) -> dict[str, Any]:
    """The comparison document (schema ``gputrace.compare/1``)."""
    by_label_b = {pm.label: pm for pm in b.metrics}
    phases = []
    for pa in a.metrics:
        pb = by_label_b.get(pa.label)
        if pb is None:
            continue
        ca, cb = _causes(a, pa.label), _causes(b, pa.label)
        phases.append({
            "label": pa.label,
            "target_concurrency": pa.target_concurrency,
            "throughput_tok_s_a": pa.throughput_tok_s,
            "throughput_tok_s_b": pb.throughput_tok_s,
            "throughput_gain": _ratio(pb.throughput_tok_s, pa.throughput_tok_s),
            "verdict": phase_verdict(_ratio(pb.throughput_tok_s, pa.throughput_tok_s)),
            "bubble_fraction_a": [s.bubble_fraction for s in pa.stages],
            "bubble_fraction_b": [s.bubble_fraction for s in pb.stages],
            "bubble_fraction_mean_a": _mean([s.bubble_fraction for s in pa.stages]),
            "bubble_fraction_mean_b": _mean([s.bubble_fraction for s in pb.stages]),
            "busy_fraction_a": [s.busy_fraction for s in pa.stages],
            "busy_fraction_b": [s.busy_fraction for s in pb.stages],
            "microbatch_size_mean_a": [s.microbatch_size_mean for s in pa.stages],
            "microbatch_size_mean_b": [s.microbatch_size_mean for s in pb.stages],
            "ttft_s_p50_a": pa.ttft_s_p50, "ttft_s_p50_b": pb.ttft_s_p50,
            "itl_s_mean_a": pa.itl_s_mean, "itl_s_mean_b": pb.itl_s_mean,
            "findings_resolved": sorted(ca - cb),
            "findings_new": sorted(cb - ca),
            "findings_kept": sorted(ca & cb),
            # in words: a resolved finding as A stated it, a new one as B states it
            "resolved": _described(a, pa.label, ca - cb),
            "new": _described(b, pa.label, cb - ca),
        })
    ra, rb = _causes(a, "*"), _causes(b, "*")
    labels_a = {pm.label for pm in a.metrics}
    return {
        "schema": SCHEMA,
        "run_a": a.run.name,
        "run_b": b.run.name,
        "run_a_dir": ref_a.dir if ref_a else None,
        "run_b_dir": ref_b.dir if ref_b else None,
        "same_run": same_run(ref_a, ref_b),
        "bottom_line": bottom_line(phases),
        "top_finding_a": top_finding(a),
        "top_finding_b": top_finding(b),
        "phases": phases,
        "unmatched_a": sorted(labels_a - set(by_label_b)),
        "unmatched_b": sorted(set(by_label_b) - labels_a),
        "run_findings_resolved": sorted(ra - rb),
        "run_findings_new": sorted(rb - ra),
        "run_resolved": _described(a, "*", ra - rb),
        "run_new": _described(b, "*", rb - ra),
    }
