"""The what-if model scored on the simulator's ground truth: fit on a virtual run's store (only
what a capture holds), predict a change, and run the simulator itself with the change."""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from gputrace.analysis.engine_metrics import COMPARED
from gputrace.analysis.result import Analysis, analyse_tables
from gputrace.sim.outputs import write_store
from gputrace.sim.truth import scenario_fixes
from gputrace.sim.virtual import SimResult, run_params, run_scenario
from gputrace.store import Store
from gputrace.whatif.fit import FittedModel, fit_model
from gputrace.whatif.param_change import ParamChange, with_changes
from gputrace.whatif.predict import even_split, predict

# Changes beside the scenarios' own fixes (Must show 1): K, the request pool, the load.
OTHER_CHANGES: tuple[tuple[str, ParamChange], ...] = (
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
    return fit_model(analysed_as_captured(result))


def analysed_as_captured(result: SimResult) -> Analysis:
    """A virtual run written to a store and analysed from it, as a captured run is (less the
    effects and advice ``gputrace.analyse.analyse_run`` adds, which are what is scored here: the
    what-if cannot call that pipeline, which calls it)."""
    with tempfile.TemporaryDirectory(prefix="gputrace-whatif-") as tmp:
        write_store(result, Path(tmp) / "run")
        with Store.open(Path(tmp) / "run", read_only=True) as store:
            return analyse_tables(store.read_run(engine_metric_names=COMPARED))


@functools.lru_cache(maxsize=2)  # a run holds up to ~100 MB of trace
def fitted_scenario(name: str, seed: int) -> tuple[SimResult, FittedModel]:
    """A scenario's virtual run and the model fitted to it, made once for the changes scored on
    it (deterministic in name and seed; the changes are predicted from the model, never made to it)."""
    result = run_scenario(name, seed)
    return result, fitted(result)


def model_change(model: FittedModel, fix_params: ParamChange) -> ParamChange:
    """A fix's simulator parameters as a change of the fitted model: a rebalanced layer split is
    an even split of the fitted work."""
    change = {k: tuple(v) if isinstance(v, list) else v for k, v in fix_params.items()}
    if "stage_cost_multipliers" in change:
        change.update(even_split(model))
    return change


def _describe(change: ParamChange) -> str:
    return ", ".join(f"{k}={','.join(map(str, v)) if isinstance(v, tuple) else v}" for k, v in change.items())


def score_fixes(name: str, seed: int) -> list[Score]:
    """Each fix of the scenario's causes (truth.scenario_fixes), at the phases it names."""
    result, model = fitted_scenario(name, seed)
    measured = {m.label: m.throughput_tok_s for m in model.measured}
    out = []
    for fix in scenario_fixes(result):
        rows = {r.label: r for r in predict(model, model_change(model, fix["params"]))}
        for label, ph in fix["phases"].items():
            out.append(Score(name, seed, f"fix {fix['knob']} ({_describe(fix['params'])})"[:80], label,
                             measured.get(label), float(rows[label].predicted.throughput_tok_s or 0.0),
                             float(ph["fixed_throughput_tok_s"])))
    return out


def score_change(name: str, seed: int, change: ParamChange) -> list[Score]:
    """A change beside the fixes, at every phase of the changed run."""
    result, model = fitted_scenario(name, seed)
    truth = run_params(with_changes(result.params, change), name, log=False)
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


@dataclass(frozen=True, slots=True)
class AdviceScore:
    """The advice for one virtual run, applied by running the simulator at the advised setting
    (same seed), beside the best single finding's change run the same way. Gains are the
    duration-weighted throughput gain over the run's phases (tok/s) where no phase loses beyond
    its band, else None (not eligible on the default objective)."""

    scenario: str
    seed: int
    advice: str  # the change set, or "keep"
    advice_gain_tok_s: float  # 0 for keep
    advice_phase_ratios: tuple[tuple[str, float, float], ...]  # (phase, truth after / before - 1, band)
    advice_loses: bool  # a phase lost beyond its band, in the simulator
    best_finding: str | None
    best_finding_gain_tok_s: float  # the best eligible finding change's gain; 0 where none is

    @property
    def ok(self) -> bool:
        """At least the best finding's gain (within 1 % of the weighted throughput's noise floor)
        and no phase lost beyond its band."""
        return not self.advice_loses and self.advice_gain_tok_s >= self.best_finding_gain_tok_s - 1e-6


def _truth_tok_s(result: SimResult) -> dict[str, float]:
    return {ph["label"]: float(ph["throughput_tok_s"]) for ph in result.ground_truth["phases"]}


def _weighted(before: Mapping[str, float], after: Mapping[str, float], weights: Mapping[str, float],
              bands: Mapping[str, float]) -> tuple[float | None, bool]:
    """(duration-weighted gain, whether a phase lost beyond its band)."""
    loses = any(after[k] < before[k] * (1 - bands.get(k, 0.0)) for k in before if before[k] > 0)
    total = sum(weights.values()) or 1.0
    gain = sum((after[k] - before[k]) * weights.get(k, 0.0) for k in before) / total
    return (None if loses else gain), loses


def score_advice(name: str, seed: int) -> AdviceScore:
    """Fit a virtual run as a capture, take its advice, run the simulator at it and at each
    finding's configuration change (same seed), and score both on the default objective."""
    from gputrace.whatif.advise import NOT_CONFIGURATION, search
    from gputrace.whatif.predict import finding_change

    result = run_scenario(name, seed)
    analysis = analysed_as_captured(result)
    model = fit_model(analysis)  # as the advise hook does where the effects fitted none
    advice, _ = search(model, analysis.findings,
                       durations={pm.label: pm.duration_s for pm in analysis.metrics})
    weights = {pm.label: pm.duration_s for pm in analysis.metrics}
    bands = {p.phase: p.band_ratio for p in advice.phases}
    before = _truth_tok_s(result)
    ratios: tuple[tuple[str, float, float], ...] = ()
    advice_gain, loses = 0.0, False
    if not advice.keep:
        change: ParamChange = {c.knob: c.value for c in advice.changes}
        if "stage_cost_multipliers" in change:
            change = model_change(model, change)
        after = _truth_tok_s(run_params(with_changes(result.params, change), name, log=False))
        gain, loses = _weighted(before, after, weights, bands)
        advice_gain = gain if gain is not None else min(0.0, sum(after.values()) - sum(before.values()))
        ratios = tuple((k, after[k] / before[k] - 1 if before[k] else 0.0, bands.get(k, 0.0)) for k in before)
    best, best_gain = None, 0.0
    tried: set[str] = set()
    for f in analysis.findings:
        if f.cause == "cannot_tell" or f.change is None or f.change.flag in NOT_CONFIGURATION:
            continue
        fix = finding_change(model, f.change, f.phase)
        if not fix or repr(sorted(fix.items())) in tried:
            continue
        tried.add(repr(sorted(fix.items())))
        fixed = with_changes(result.params, model_change(model, fix))
        after = _truth_tok_s(run_params(fixed, name, log=False))
        gain, _ = _weighted(before, after, weights, bands)
        if gain is not None and gain > best_gain:
            value = "" if f.change.value is None else f" {f.change.value}"  # a layer split has none
            best, best_gain = f"{f.change.flag}{value} ({f.cause})", gain
    text = "keep" if advice.keep else ", ".join(c.text() for c in advice.changes)
    return AdviceScore(name, seed, text, advice_gain, ratios, loses, best, best_gain)


def format_advice_table(scores: list[AdviceScore]) -> list[str]:
    lines = [f"{'scenario':16s} {'seed':>4s} {'advice':34s} {'gain tok/s':>10s} {'best finding':34s} "
             f"{'gain tok/s':>10s} {'ok':>3s}  phases (truth gain / band)"]
    for s in scores:
        phases = " ".join(f"{k} {r:+.0%}/{b:.0%}" for k, r, b in s.advice_phase_ratios)
        lines.append(f"{s.scenario:16s} {s.seed:4d} {s.advice[:34]:34s} {s.advice_gain_tok_s:10.1f} "
                     f"{(s.best_finding or '-')[:34]:34s} {s.best_finding_gain_tok_s:10.1f} "
                     f"{'yes' if s.ok else 'NO':>3s}  {phases}")
    return lines
