"""Run A against run B per matching phase (by label): throughput, bubble fraction per stage, and
which findings the change resolved or introduced."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gputrace.analysis.diagnose import Finding
from gputrace.analysis.run import Analysis

SCHEMA = "gputrace.compare/1"


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
