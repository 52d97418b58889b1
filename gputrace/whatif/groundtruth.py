"""The what-if model scored on the simulator's ground truth: fit on a virtual run's store (only
what a capture holds), predict a change, and run the simulator itself with the change."""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gputrace.analysis.run import analyse_store
from gputrace.sim.outputs import write_store
from gputrace.sim.run import SimResult, run_params, run_scenario
from gputrace.sim.truth import scenario_fixes
from gputrace.store import Store
from gputrace.whatif.fit import FittedModel, fit_model
from gputrace.whatif.predict import even_split, predict

# Changes beside the scenarios' own fixes (Must show 1): K, the request pool, the load.
OTHER_CHANGES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("motivating", {"pp_max_micro_batch_size": 4}),
    ("motivating", {"max_running_requests": 128}),
    ("motivating", {"concurrency": (16, 48, 96)}),
    ("healthy", {"pp_max_micro_batch_size": 4}),
)


@dataclass(frozen=True, slots=True)
class Score:
    """One change at one phase: predicted against the simulator's throughput."""

    scenario: str
    seed: int
    change: str
    phase: str
    measured_tok_s: float | None  # the fitted run's phase, before the change
    predicted_tok_s: float
    truth_tok_s: float

    @property
    def error_ratio(self) -> float:
        return self.predicted_tok_s / self.truth_tok_s - 1.0 if self.truth_tok_s > 0 else 0.0


def fitted(result: SimResult) -> FittedModel:
    """The model fitted to a virtual run through its store, as a captured run would be."""
    with tempfile.TemporaryDirectory(prefix="gputrace-whatif-") as tmp:
        write_store(result, Path(tmp) / "run")
        with Store.open(Path(tmp) / "run", read_only=True) as store:
            analysis = analyse_store(store)
    return fit_model(analysis)


def model_change(model: FittedModel, fix_params: Mapping[str, Any]) -> dict[str, Any]:
    """A fix's simulator parameters as a change of the fitted model: a rebalanced layer split is
    an even split of the fitted work."""
    change = {k: tuple(v) if isinstance(v, list) else v for k, v in fix_params.items()}
    if "stage_cost_multipliers" in change:
        change.update(even_split(model))
    return change


def _describe(change: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={','.join(map(str, v)) if isinstance(v, tuple) else v}" for k, v in change.items())


def score_fixes(name: str, seed: int) -> list[Score]:
    """Each fix of the scenario's causes (truth.scenario_fixes), at the phases it names."""
    result = run_scenario(name, seed)
    model = fitted(result)
    measured = {m.label: m.throughput_tok_s for m in model.measured}
    out = []
    for fix in scenario_fixes(result):
        rows = {r.label: r for r in predict(model, model_change(model, fix["params"]))}
        for label, ph in fix["phases"].items():
            out.append(Score(name, seed, f"fix {fix['knob']} ({_describe(fix['params'])})"[:80], label,
                             measured.get(label), float(rows[label].predicted.throughput_tok_s or 0.0),
                             float(ph["fixed_throughput_tok_s"])))
    return out


def score_change(name: str, seed: int, change: Mapping[str, Any]) -> list[Score]:
    """A change beside the fixes, at every phase of the changed run."""
    result = run_scenario(name, seed)
    model = fitted(result)
    truth = run_params(dataclasses.replace(result.params, **change), name)
    predicted = predict(model, change)
    out = []
    for row, ph in zip(predicted, truth.ground_truth["phases"], strict=True):
        out.append(Score(name, seed, _describe(change), row.label,
                         row.measured.throughput_tok_s if row.measured else None,
                         float(row.predicted.throughput_tok_s or 0.0), float(ph["throughput_tok_s"])))
    return out


def format_table(scores: list[Score]) -> list[str]:
    lines = [f"{'scenario':16s} {'seed':>4s} {'change':44s} {'phase':>6s} {'before':>8s} "
             f"{'predicted':>9s} {'truth':>8s} {'error':>7s}"]
    for s in scores:
        before = "n/a" if s.measured_tok_s is None else f"{s.measured_tok_s:.0f}"
        lines.append(f"{s.scenario:16s} {s.seed:4d} {s.change[:44]:44s} {s.phase:>6s} {before:>8s} "
                     f"{s.predicted_tok_s:9.0f} {s.truth_tok_s:8.0f} {s.error_ratio:+7.1%}")
    return lines
