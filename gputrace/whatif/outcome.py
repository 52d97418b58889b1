"""What a phase gave, in one form for a captured phase and a simulated one: throughput, TTFT and
ITL percentiles, bubble per stage. The same latency definitions as gputrace.analysis.metrics."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from gputrace.analysis.metrics import PhaseMetrics
from gputrace.analysis.run import Analysis
from gputrace.sim.run import SimResult


@dataclass(frozen=True, slots=True)
class PhaseOutcome:
    """One load level's result; None where it is not known."""

    label: str
    concurrency: int
    throughput_tok_s: float | None
    ttft_s_p50: float | None
    ttft_s_p90: float | None
    itl_s_p50: float | None
    itl_s_p90: float | None
    bubble_fraction_by_stage: tuple[float | None, ...]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _pct(values: np.ndarray, q: float) -> float | None:
    v = values[np.isfinite(values)]
    return float(np.percentile(v, q)) if len(v) else None


Latencies = tuple[float | None, float | None, float | None, float | None]
NO_LATENCIES: Latencies = (None, None, None, None)


def latency_percentiles(start_s: np.ndarray, first_s: np.ndarray, end_s: np.ndarray,
                        tokens: np.ndarray) -> Latencies:
    """TTFT p50/p90 and per-request ITL p50/p90 (the request's decode time over its tokens - 1)."""
    ttft = first_s - start_s
    with np.errstate(all="ignore"):
        itl = np.where(tokens > 1, (end_s - first_s) / (tokens - 1), np.nan)
    return _pct(ttft, 50), _pct(ttft, 90), _pct(itl, 50), _pct(itl, 90)


def phase_concurrency(pm: PhaseMetrics) -> int:
    """The level a phase offered: its target, else its mean in flight."""
    if pm.target_concurrency:
        return int(pm.target_concurrency)
    return max(round(pm.inflight_mean or 1.0), 1)


def measured_outcomes(analysis: Analysis) -> list[PhaseOutcome]:
    """Each captured phase, from the analysis and the run's request records."""
    rq = analysis.run.requests
    out = []
    for pm in analysis.metrics:
        if len(rq["start_ns"]):
            labelled = rq["phase"] == pm.label
            ended = (rq["end_ns"] >= pm.start_ns) & (rq["end_ns"] < pm.end_ns)
            in_phase = labelled if labelled.any() else ended
            sel = in_phase & rq["ok"]
            lat = latency_percentiles(rq["start_ns"][sel] / 1e9, rq["first_token_ns"][sel] / 1e9,
                                      rq["end_ns"][sel] / 1e9, rq["completion_tokens"][sel].astype(float))
        else:
            lat = NO_LATENCIES
        out.append(PhaseOutcome(pm.label, phase_concurrency(pm), pm.throughput_tok_s, *lat,
                                tuple(st.bubble_fraction for st in pm.stages)))
    return out


def simulated_outcomes(result: SimResult, labels: list[str] | None = None) -> list[PhaseOutcome]:
    """Each phase of a virtual run (named ``labels[i]`` where given) from its ground truth and
    its requests as the client saw them."""
    lat_s = result.params.client_latency_s
    out = []
    for i, (ph, truth) in enumerate(zip(result.phases, result.ground_truth["phases"], strict=True)):
        reqs = [r for r in result.requests if r.phase == ph.label and r.first_token_s is not None
                and r.finish_s is not None and r.generated >= r.output_tokens]
        start = np.array([r.client_start_s for r in reqs])
        first = np.array([r.first_token_s + lat_s for r in reqs if r.first_token_s is not None])
        end = np.array([r.finish_s + lat_s for r in reqs if r.finish_s is not None])
        tokens = np.array([r.generated for r in reqs], dtype=float)
        lat = latency_percentiles(start, first, end, tokens) if reqs else NO_LATENCIES
        label = labels[i] if labels and i < len(labels) else ph.label
        out.append(PhaseOutcome(label, ph.target_concurrency, float(truth["throughput_tok_s"]), *lat,
                                tuple(float(s["bubble_fraction"]) for s in truth["stages"])))
    return out
