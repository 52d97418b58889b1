"""Run A against run B per matching phase (by label): throughput, bubble fraction per stage, and
which findings the change resolved or introduced."""

from __future__ import annotations

from typing import Any

from gputrace.analysis.run import Analysis

SCHEMA = "gputrace.compare/1"


def _causes(a: Analysis, phase: str) -> set[str]:
    return {f.cause for f in a.findings if f.phase == phase}


def _ratio(b: float | None, a: float | None) -> float | None:
    return b / a if a and b is not None else None


def compare_analyses(a: Analysis, b: Analysis) -> dict[str, Any]:
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
            "busy_fraction_a": [s.busy_fraction for s in pa.stages],
            "busy_fraction_b": [s.busy_fraction for s in pb.stages],
            "microbatch_size_mean_a": [s.microbatch_size_mean for s in pa.stages],
            "microbatch_size_mean_b": [s.microbatch_size_mean for s in pb.stages],
            "ttft_s_p50_a": pa.ttft_s_p50, "ttft_s_p50_b": pb.ttft_s_p50,
            "itl_s_mean_a": pa.itl_s_mean, "itl_s_mean_b": pb.itl_s_mean,
            "findings_resolved": sorted(ca - cb),
            "findings_new": sorted(cb - ca),
            "findings_kept": sorted(ca & cb),
        })
    ra, rb = _causes(a, "*"), _causes(b, "*")
    labels_a = {pm.label for pm in a.metrics}
    return {
        "schema": SCHEMA,
        "run_a": a.run.name,
        "run_b": b.run.name,
        "phases": phases,
        "unmatched_a": sorted(labels_a - set(by_label_b)),
        "unmatched_b": sorted(set(by_label_b) - labels_a),
        "run_findings_resolved": sorted(ra - rb),
        "run_findings_new": sorted(rb - ra),
    }
