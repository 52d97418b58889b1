"""One answer for the deployment: the configuration that serves the run's measured load best.

Candidates are every finding's change (the load's findings excepted: "offer more requests" is a
fact about the load, not a setting) and, around the run's settings, the engine knobs the
simulator models (SGLang: K, the request pool, the prefill chunk, the async depth; vLLM:
max_num_seqs and max_num_batched_tokens), alone and in pairs, a few dozen at most. Each is
replayed by the calibrated model under the run's own phases (screened on one replay seed, the
best confirmed on all of them; a change already predicted in full, a finding's for its effect,
is screened by that prediction). The objective, by default: no phase loses beyond its band, and the
most throughput gained over the phases weighted by their duration; ``peak`` (the highest load
level) and an SLO (the most throughput whose every phase meets it) as options. Where no
candidate clears its band the advice is to keep the current settings, with the reason.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypedDict

import numpy as np

from gputrace.analysis.diagnose import Finding
from gputrace.analysis.predicted import cannot_predict, predictable
from gputrace.analysis.result import Analysis
from gputrace.engines import ENGINE_WORDS, engine_words
from gputrace.errors import GputraceError, UsageError
from gputrace.sim.params import SimParams
from gputrace.vocabulary import Cause
from gputrace.whatif.effects import fit_note
from gputrace.whatif.fit import FittedModel, fit_model
from gputrace.whatif.outcome import PhaseOutcome
from gputrace.whatif.param_change import ParamChange, ParamJson, ParamValue, param_json
from gputrace.whatif.predict import (
    finding_change,
    predict,
    predicted_already,
    prefill_budget_change,
)
from gputrace.whatif.prediction import PhasePrediction, decision_band

OBJECTIVES = ("throughput", "peak", "slo")
SCREEN_SEEDS = (0,)  # a candidate's first replay; the best CONFIRM are replayed at every seed
SCREEN_PHASE_S = 30.0  # a screening replay's phases at most this long (the run as it ran as long)
CONFIRM = 2
MAX_CANDIDATES = 36
PAIR_FROM = 4  # the best single changes combined in pairs
SLO_KEYS = ("ttft_p90", "itl_p90")
NOT_CONFIGURATION = frozenset({"concurrency", "client", "link", "cooling/power",
                               *(k.flag for w in ENGINE_WORDS.values() for k in w.knobs if not k.serving)})


class AdvisedSettingRow(TypedDict):
    """An ``AdvisedSetting`` as the advice's JSON gives it: the engine's name for the knob."""

    knob: str
    flag: str
    value: ParamJson


class PhaseAdviceRow(TypedDict):
    """A ``PhaseAdvice`` as the advice's JSON gives it, rounded, with its gain."""

    phase: str
    concurrency: int
    duration_s: float
    measured_tok_s: float
    unchanged_tok_s: float | None
    predicted_tok_s: float
    gain_ratio: float
    band_ratio: float
    model_band_ratio: float | None
    ttft_s_p90: float | None
    itl_s_p90: float | None
    extrapolation: str | None


class OptionRow(TypedDict):
    """An ``Option`` as the advice's JSON gives it, with its sentence."""

    changes: list[AdvisedSettingRow]
    origin: str
    weighted_gain_tok_s: float
    phases: list[PhaseAdviceRow]
    text: str


class AdviceRow(TypedDict):
    """The ``Advice`` as findings.json's ``advice`` and ``whatif --search`` give it."""

    changes: list[AdvisedSettingRow]
    objective: str
    slo: dict[str, float]
    phases: list[PhaseAdviceRow]
    alternatives: list[OptionRow]
    reason: str
    candidates: int
    fit: str
    to_measure: list[AdvisedSettingRow]
    sentence: str


@dataclass(frozen=True, slots=True)
class AdvisedSetting:
    """One setting of the advice: the simulator's knob, the engine's flag, the value (a tuple for
    a layer split, which a finding's ``Change`` does not carry)."""

    knob: str
    flag: str
    value: ParamValue
    setting: str | None = None  # the engine's own name for the knob (vLLM's max_num_seqs)

    def to_dict(self) -> AdvisedSettingRow:
        return {"knob": self.setting or self.knob, "flag": self.flag, "value": param_json(self.value)}

    def text(self) -> str:
        if self.knob == "stage_cost_multipliers":
            return f"{self.flag} (an even layer split)"
        return f"{self.flag} {self.value}"


@dataclass(frozen=True, slots=True)
class PhaseAdvice:
    """One phase under a change set: measured, the calibrated model as run, and predicted."""

    phase: str
    concurrency: int
    duration_s: float
    measured_tok_s: float
    unchanged_tok_s: float | None
    predicted_tok_s: float
    band_ratio: float
    ttft_s_p90: float | None
    itl_s_p90: float | None
    extrapolation: str | None = None
    model_band_ratio: float | None = None  # band_ratio without the phase's run-to-run spread

    @property
    def gain_ratio(self) -> float:
        return float(self.predicted_tok_s / self.measured_tok_s - 1.0) if self.measured_tok_s > 0 else 0.0

    @property
    def decision_band_ratio(self) -> float:
        """What a predicted gain or loss must exceed to count (decision_band)."""
        return decision_band(self.band_ratio, self.model_band_ratio)

    @property
    def gains(self) -> bool:
        # bool(): the replay's medians are numpy's, and numpy's bool is no JSON value
        return bool(self.gain_ratio > self.decision_band_ratio)

    @property
    def loses(self) -> bool:
        return bool(self.gain_ratio < -self.decision_band_ratio)

    def band_text(self) -> str:
        """``±28 %``, or ``±8 %; ±28 % with this phase's run-to-run spread`` where they differ."""
        if self.band_ratio - self.decision_band_ratio < 0.01:
            return f"±{self.band_ratio:.0%}"
        return f"±{self.decision_band_ratio:.0%}; ±{self.band_ratio:.0%} with this phase's run-to-run spread"

    def moved_text(self) -> str:
        """``C=32 246 -> 416 tok/s (+69% ±17%)``; where the band is too wide to state a figure, the
        direction it is sure of and why no figure."""
        if not predictable(self.decision_band_ratio):
            why = cannot_predict(self.decision_band_ratio)
            return f"{self.phase} gains beyond its band ({why} by how much)"
        return (f"{self.phase} {self.measured_tok_s:.0f} -> {self.predicted_tok_s:.0f} tok/s "
                f"({self.gain_ratio:+.0%} {self.band_text()})")

    def in_time(self, speed: float) -> PhaseAdvice:
        """Its tok/s over ``speed`` (Advice.in_time); ratios and latencies as they are."""
        return dataclasses.replace(
            self, measured_tok_s=self.measured_tok_s / speed, predicted_tok_s=self.predicted_tok_s / speed,
            unchanged_tok_s=None if self.unchanged_tok_s is None else self.unchanged_tok_s / speed)

    def to_dict(self) -> PhaseAdviceRow:
        def r(x: float | None, n: int) -> float | None:
            return None if x is None else round(x, n)

        return {"phase": self.phase, "concurrency": self.concurrency,
                "duration_s": round(self.duration_s, 1), "measured_tok_s": round(self.measured_tok_s, 1),
                "unchanged_tok_s": r(self.unchanged_tok_s, 1),
                "predicted_tok_s": round(self.predicted_tok_s, 1), "gain_ratio": round(self.gain_ratio, 4),
                "band_ratio": round(self.band_ratio, 4), "model_band_ratio": r(self.model_band_ratio, 4),
                "ttft_s_p90": r(self.ttft_s_p90, 4),
                "itl_s_p90": r(self.itl_s_p90, 5), "extrapolation": self.extrapolation}


@dataclass(frozen=True, slots=True)
class Option:
    """A candidate change set and its predicted effect per phase."""

    changes: tuple[AdvisedSetting, ...]
    phases: tuple[PhaseAdvice, ...]
    origin: str  # "finding: cause at phase" or "around the run's settings"

    @property
    def weighted_gain_tok_s(self) -> float:
        """Throughput gained over the run's phases, weighted by their duration."""
        total = sum(p.duration_s for p in self.phases)
        if total <= 0:
            return 0.0
        return sum((p.predicted_tok_s - p.measured_tok_s) * p.duration_s for p in self.phases) / total

    def describe(self) -> str:
        """``--pp-max-micro-batch-size 4: +9 % at C=8, C=32; -45 % at C=64``."""
        name = ", ".join(c.text() for c in self.changes) or "keep"
        ups = [f"{p.gain_ratio:+.0%} at {p.phase}" for p in self.phases if p.gains]
        downs = [f"{p.gain_ratio:+.0%} at {p.phase}" for p in self.phases if p.loses]
        moves = "; ".join(ups + downs) or "no phase moves beyond its band"
        return f"{name}: {moves}"

    def in_time(self, speed: float) -> Option:
        return dataclasses.replace(self, phases=tuple(p.in_time(speed) for p in self.phases))

    def to_dict(self) -> OptionRow:
        return {"changes": [c.to_dict() for c in self.changes], "origin": self.origin,
                "weighted_gain_tok_s": round(self.weighted_gain_tok_s, 1),
                "phases": [p.to_dict() for p in self.phases], "text": self.describe()}


@dataclass(frozen=True, slots=True)
class Advice:
    """The configuration to run (``changes`` empty: keep the current settings), per phase
    measured -> predicted, the alternatives that trade, and why."""

    changes: tuple[AdvisedSetting, ...]
    objective: str
    phases: tuple[PhaseAdvice, ...]
    alternatives: tuple[Option, ...]
    reason: str
    candidates: int  # change sets replayed
    slo: Mapping[str, float] = field(default_factory=dict)
    fit: str = ""  # the model's replay of the run as it ran, and its corrections (fit_note)
    # where the advice keeps: a finding's change the model cannot price (its sizes lie past the
    # run's), to rerun and measure (unpriced)
    to_measure: tuple[AdvisedSetting, ...] = ()

    @property
    def keep(self) -> bool:
        return not self.changes

    def sentence(self) -> str:
        """The verdict in one sentence."""
        if self.keep and self.to_measure:
            what = ", ".join(c.text() for c in self.to_measure)
            return f"Keep the current settings, and rerun with {what} to measure it: {self.reason}."
        if self.keep:
            return f"Keep the current settings: {self.reason}."
        what = ", ".join(c.text() for c in self.changes)
        ups = [p for p in self.phases if p.gains]
        moved = ", ".join(p.moved_text() for p in ups)
        return f"Set {what}: predicted {moved or 'no phase beyond its band'}; {self.reason}."

    def in_time(self, speed: float) -> Advice:
        """The advice with every tok/s over ``speed``: a run captured against an engine that ran
        ``speed`` x the wall clock (the demo's live runs), stated in the deployment's time."""
        if speed == 1.0:
            return self
        weighted = Option(self.changes, self.phases, "").weighted_gain_tok_s
        said = _average_gain_text(weighted)
        reason = self.reason.replace(said, _average_gain_text(weighted / speed)) if said in self.reason \
            else self.reason
        return dataclasses.replace(self, phases=tuple(p.in_time(speed) for p in self.phases),
                                   alternatives=tuple(a.in_time(speed) for a in self.alternatives),
                                   reason=reason)

    def to_dict(self) -> AdviceRow:
        return {"changes": [c.to_dict() for c in self.changes], "objective": self.objective,
                "slo": dict(self.slo), "phases": [p.to_dict() for p in self.phases],
                "alternatives": [a.to_dict() for a in self.alternatives], "reason": self.reason,
                "candidates": self.candidates, "fit": self.fit,
                "to_measure": [c.to_dict() for c in self.to_measure], "sentence": self.sentence()}


def parse_slo(text: str | None) -> dict[str, float]:
    """``ttft_p90=2s,itl_p90=80ms`` -> {"ttft_p90": 2.0, "itl_p90": 0.08} (seconds)."""
    out: dict[str, float] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise UsageError(f"--slo {item!r}: expected {' or '.join(k + '=VALUE' for k in SLO_KEYS)}")
        scale = 1e-3 if value.endswith("ms") else 1.0
        number = value.removesuffix("ms").removesuffix("s")
        try:
            out[key] = float(number) * scale
        except ValueError:
            raise UsageError(f"--slo {item!r}: {value!r} is not a time (2s, 80ms)") from None
        if out[key] <= 0:
            raise UsageError(f"--slo {item!r}: must be > 0")
    return out


def to_change(model: FittedModel, knob: str, value: ParamValue) -> AdvisedSetting | None:
    """The advice's setting for the simulator's parameter ``knob``, in the run's engine's flag;
    None where the engine has no knob the simulator models by it (or one that changes only what
    the log shows)."""
    words = engine_words(model.params.engine)
    made = words.knob_of_param(knob)
    if made is None or not made.serving:
        return None
    return AdvisedSetting(knob, made.value_flag or made.flag, value, words.setting(knob))


def _neighbours(model: FittedModel) -> list[ParamChange]:
    """Single changes around the run's settings on the knobs the simulator models."""
    p = model.params
    levels = sorted({m.concurrency for m in model.measured if m.concurrency > 0})
    top = levels[-1] if levels else p.max_running_requests
    out: list[ParamChange] = []
    if p.engine_spec.microbatch_slots:
        k0 = p.micro_batch_cap
        ks = {k0 // 2, k0 * 2, *(max(-(-c // p.slots), 1) for c in levels)}
        out += [{"pp_max_micro_batch_size": k} for k in sorted(ks)
                if 1 <= k <= p.max_running_requests and k != k0]
        depth = p.pp_async_batch_depth
        out += [{"pp_async_batch_depth": d} for d in (depth + 1, depth + 2) if d != depth]
    pools = {p.max_running_requests * 2, top} - {p.max_running_requests}
    if not p.engine_spec.microbatch_slots:
        pools |= {max(p.max_running_requests // 2, 1)}
    out += [{"max_running_requests": m} for m in sorted(pools) if m >= 1]
    out += [prefill_budget_change(p, c) for c in prefill_budgets(p)]
    return out


PREFILL_STEPS = 4  # budgets tried above the run's at most, log-spaced up to the context length


def prefill_budgets(p: SimParams) -> list[int]:
    """The prefill budgets the search tries: half the run's, and from the run's up to the context
    length, log-spaced (SGLang's chunked_prefill_size, vLLM's max_num_batched_tokens): a chunk
    smaller than the prompts makes them take turns one chunk at a time (issue 47: 256 -> 4096
    measured x2.06 on SGLang), a larger one lets long prefills hold the other micro-batches."""
    chunk = p.chunked_prefill_size
    # powers of two above the run's, the last one holding the longest context
    top = 1 << max(math.ceil(math.log2(max(p.context_len, 1))), 0)
    ups = [1 << e for e in range(chunk.bit_length(), top.bit_length()) if 1 << e > chunk]
    if len(ups) > PREFILL_STEPS:  # evenly in log, the largest kept
        ups = [ups[int(i)] for i in np.round(np.linspace(0, len(ups) - 1, PREFILL_STEPS))]
    return sorted({v for v in (chunk // 2, *ups) if v >= 64 and v != chunk})


PREFILL_KNOBS = frozenset({"chunked_prefill_size", "max_prefill_tokens"})


def prefill_pairs(singles: Sequence[tuple[ParamChange, Option]]) -> list[ParamChange]:
    """The best prefill budget beside the best K and the best pool, whether or not they were
    among the best singles: the budget sets how many requests a turn admits, K and the pool how
    many a micro-batch and the engine hold, so one may need the other."""
    def best(knobs: frozenset[str]) -> ParamChange | None:
        fits = [(c, o) for c, o in singles if c and set(c) <= knobs]
        return max(fits, key=lambda s: s[1].weighted_gain_tok_s)[0] if fits else None

    budget = best(PREFILL_KNOBS)
    if budget is None:
        return []
    others = (best(frozenset({"pp_max_micro_batch_size"})), best(frozenset({"max_running_requests"})))
    return [{**budget, **other} for other in others if other is not None]


def _key(change: ParamChange) -> str:
    return repr(sorted(change.items()))


def changes_of(model: FittedModel, change: ParamChange) -> tuple[AdvisedSetting, ...] | None:
    out = []
    for knob, value in change.items():
        if knob == "max_prefill_tokens" and ("chunked_prefill_size" in change and (
                engine_words(model.params.engine).knob_of_param(knob) is None
                or value == model.params.max_prefill_tokens)):
            continue  # rides with the chunk: the engine's one budget (vLLM's), or SGLang's left as it ran
        c = to_change(model, knob, value)
        if c is None:
            return None
        out.append(c)
    return tuple(out)


def candidates(model: FittedModel, findings: Sequence[Finding]) -> list[tuple[ParamChange, str]]:
    """(change, origin): each finding's configuration change, then the neighbours; deduplicated."""
    out: dict[str, tuple[ParamChange, str]] = {}
    for f in findings:
        made = f.change
        if f.cause is Cause.CANNOT_TELL or made is None or not made.flag or made.flag in NOT_CONFIGURATION:
            continue
        change = finding_change(model, made, f.phase)
        if change and changes_of(model, change) is not None:
            out.setdefault(_key(change), (change, f"finding: {f.cause} at {f.phase}"))
    for change in _neighbours(model):
        if changes_of(model, change) is not None:  # knobs the run's engine has
            out.setdefault(_key(change), (change, "around the run's settings"))
    return list(out.values())[:MAX_CANDIDATES]


def _phases(model: FittedModel, rows: list[PhasePrediction], durations: Mapping[str, float]
            ) -> tuple[PhaseAdvice, ...]:
    out = []
    for r in rows:
        m = r.measured
        if m is None or not m.throughput_tok_s or r.predicted.throughput_tok_s is None:
            continue
        out.append(PhaseAdvice(m.label, m.concurrency, durations.get(m.label, 1.0), m.throughput_tok_s,
                               r.unchanged.throughput_tok_s if r.unchanged else None,
                               r.predicted.throughput_tok_s, r.band_ratio, r.predicted.ttft_s_p90,
                               r.predicted.itl_s_p90, r.extrapolation, r.model_band_ratio))
    return tuple(out)


def phases_of(model: FittedModel, change: ParamChange, durations: Mapping[str, float]
              ) -> tuple[PhaseAdvice, ...]:
    """Per phase, what the advice states of one change set: measured, the model as run, the
    confirmed prediction and its band (as the search confirms its best options)."""
    return _phases(model, predict(model, change), durations)


def _meets(phases: Sequence[PhaseAdvice], slo: Mapping[str, float]) -> bool:
    for p in phases:
        for key, limit in slo.items():
            value = p.ttft_s_p90 if key == "ttft_p90" else p.itl_s_p90
            if value is not None and value > limit:
                return False
    return True


def score(o: Option, objective: str, slo: Mapping[str, float]) -> float | None:
    """The objective's figure for an option; None where it is not eligible (a phase lost beyond
    its band, the SLO missed, or no phase gained beyond its band)."""
    if not o.phases:
        return None
    if objective == "peak":
        top = max(o.phases, key=lambda p: p.concurrency)
        return top.predicted_tok_s - top.measured_tok_s if top.gains else None
    if any(p.loses for p in o.phases) or not any(p.gains for p in o.phases):
        return None
    if objective == "slo" and not _meets(o.phases, slo):
        return None
    gain = o.weighted_gain_tok_s
    return gain if gain > 0 else None


def _durations(model: FittedModel, durations: Mapping[str, float] | None) -> dict[str, float]:
    return {m.label: float((durations or {}).get(m.label) or 1.0) for m in model.measured}


def search(model: FittedModel, findings: Sequence[Finding], objective: str = "throughput",
           slo: Mapping[str, float] | None = None, durations: Mapping[str, float] | None = None
           ) -> tuple[Advice, dict[str, list[PhasePrediction]]]:
    """The advice for the fitted run, and every confirmed prediction (change key -> rows) for
    reuse (a finding's predicted effect)."""
    if objective not in OBJECTIVES:
        raise UsageError(f"--objective {objective!r}: choose from {', '.join(OBJECTIVES)}")
    slo = dict(slo or {})
    if objective == "slo" and not slo:
        raise UsageError("the slo objective needs --slo ttft_p90=2s,itl_p90=80ms (one or both)")
    weights = _durations(model, durations)
    pool = candidates(model, findings)
    screened: list[tuple[ParamChange, str, Option]] = []
    for change, origin in pool:
        changes = changes_of(model, change)
        assert changes is not None
        rows = _screen(model, change, objective)
        screened.append((change, origin, Option(changes, _phases(model, rows, weights), origin)))
    # pairs of the best single changes on different knobs
    singles = sorted(screened, key=lambda s: -s[2].weighted_gain_tok_s)[:PAIR_FROM]
    seen = {_key(c) for c, _, _ in screened}

    def screen_pair(pair: ParamChange) -> None:
        """Screen a pair not screened yet."""
        if _key(pair) in seen:
            return
        seen.add(_key(pair))
        changes = changes_of(model, pair)
        assert changes is not None
        rows = _screen(model, pair, objective)
        screened.append((pair, "pair", Option(changes, _phases(model, rows, weights), "pair")))

    for i, (a, _, _) in enumerate(singles):
        for b, _, _ in singles[i + 1:]:
            if not set(a) & set(b) and len(screened) < MAX_CANDIDATES + PAIR_FROM * 2:
                screen_pair({**a, **b})
    for pair in prefill_pairs([(c, o) for c, _, o in screened]):
        screen_pair(pair)

    def rank(o: Option) -> float:
        s = score(o, objective, slo)
        return -math.inf if s is None else s

    # the best by the objective, and the best trades (the most gained anywhere), confirmed
    by_objective = sorted(screened, key=lambda s: -rank(s[2]))[:CONFIRM]
    by_gain = sorted(screened, key=lambda s: -s[2].weighted_gain_tok_s)[:CONFIRM]
    confirmed: dict[str, list[PhasePrediction]] = {}
    options: list[Option] = []
    for change, origin, _ in [*by_objective, *by_gain]:
        if _key(change) in confirmed:
            continue
        rows = predict(model, change)
        confirmed[_key(change)] = rows
        changes = changes_of(model, change)
        assert changes is not None
        options.append(Option(changes, _phases(model, rows, weights), origin))
    # the parts of the best pair, confirmed too: fewest_changes_within_band keeps a setting only
    # where it adds beyond the band to the set without it, which it can tell only where that set
    # was replayed as fully (kv-bound: two pairs screened above the KV size alone, which went
    # unconfirmed, and the advice kept --chunked-prefill-size 4096 beside it for a predicted -1 %)
    best_pair = max((o for o in options if score(o, objective, slo) is not None and len(o.changes) > 1),
                    key=rank, default=None)
    pair_settings = set(best_pair.changes) if best_pair is not None else set()
    for change, origin, o in screened:
        if _key(change) in confirmed or not set(o.changes) < pair_settings:
            continue
        rows = predict(model, change)
        confirmed[_key(change)] = rows
        options.append(Option(o.changes, _phases(model, rows, weights), origin))
    as_run = _phases(model, [PhasePrediction(m.label, m.concurrency, m, m, model.band_ratio(m.label),
                                             _unchanged(model, m.label), None, None, model.uncertainty_ratio)
                             for m in model.measured],
                     weights)
    eligible = sorted((o for o in options if score(o, objective, slo) is not None),
                      key=lambda o: -(score(o, objective, slo) or 0.0))
    trades = [o for o in sorted(options, key=lambda o: -o.weighted_gain_tok_s)
              if any(p.gains for p in o.phases)]
    n = len(screened)
    if eligible:
        best = fewest_changes_within_band(eligible, objective)
        alternatives = tuple([o for o in eligible[1:] + trades if o is not best][:3])
        return Advice(best.changes, objective, best.phases, _unique(alternatives), _why(best, objective),
                      n, slo, fit_note(model)), confirmed
    tried = sorted(options, key=lambda o: (not o.origin.startswith("finding: "), -o.weighted_gain_tok_s))
    closest = tried[0] if tried else None
    to_measure = closest.changes if not trades and closest is not None and unpriced(closest) else ()
    return Advice((), objective, as_run, _unique(tuple(trades[:3])),
                  _keep_reason(trades, objective, slo, n, closest),
                  n, slo, fit_note(model), to_measure), confirmed


def unpriced(option: Option) -> PhaseAdvice | None:
    """A finding's change the model cannot price because it runs sizes past the run's: its phase
    of most gain, where that band is wider than PREDICTABLE_BAND_RATIO for an extrapolation and
    no phase loses beyond its band. The SGLang chunk case on this CPU: the run's turns were 256
    tokens, the finding's --chunked-prefill-size 2048 was priced x1.00 ±63 % and measured x1.79."""
    if not option.origin.startswith("finding: ") or not option.phases or any(p.loses for p in option.phases):
        return None
    top = max(option.phases, key=lambda p: p.gain_ratio)
    return top if top.extrapolation and not predictable(top.decision_band_ratio) else None


def fewest_changes_within_band(ranked: Sequence[Option], objective: str = "throughput") -> Option:
    """The best of ``ranked`` (best first), or a part of its change set where the rest adds nothing
    the model can tell from its band: a setting is advised only where its own effect, on top of
    the others, lies beyond the band on the objective's figure (the duration-weighted throughput;
    the highest level's for ``peak``). One phase's gain is not enough: kv-bound seed 1 was advised
    --chunked-prefill-size 4096 beside the KV size for +5.4 % at C=32 (band 3 %) and nothing at
    C=64, +2.2 % on the weighted figure against its 4.4 % band; the simulator gave the pair +6 %
    at C=32 and -5 % at C=64, 232 against the KV size's 236 tok/s (over seeds 0-4 the chunk adds
    +1.8 % and -2.6 %)."""
    best = ranked[0]
    chosen = set(best.changes)
    for o in ranked[1:]:
        if set(o.changes) < chosen and not _beyond_band(best, o, objective):
            return fewest_changes_within_band([o, *[r for r in ranked[1:] if r is not o]], objective)
    return best


def _beyond_band(more: Option, fewer: Option, objective: str) -> bool:
    """Whether ``more`` is predicted above ``fewer`` on the objective's figure by more than the
    band of ``more``'s (each phase's band weighted as its throughput is)."""
    by_phase = {p.phase: p for p in fewer.phases}
    shared = [p for p in more.phases if p.phase in by_phase]
    if objective == "peak" and shared:
        shared = [max(shared, key=lambda p: p.concurrency)]
    total_s = sum(p.duration_s for p in shared)
    if total_s <= 0:
        return False
    added = sum((p.predicted_tok_s - by_phase[p.phase].predicted_tok_s) * p.duration_s for p in shared)
    band = sum(p.predicted_tok_s * p.decision_band_ratio * p.duration_s for p in shared)
    return added > band


def _screen(model: FittedModel, change: ParamChange, objective: str) -> list[PhasePrediction]:
    """A candidate's screening: its full prediction where one was made (a finding's change,
    predicted for its effect: no replay), else a short replay at SCREEN_SEEDS, undrained unless
    the objective reads latencies (the SLO's): score() reads only throughput otherwise."""
    return predicted_already(model, change) or predict(model, change, SCREEN_SEEDS, SCREEN_PHASE_S,
                                                       latencies=objective == "slo")


def _unchanged(model: FittedModel, label: str) -> PhaseOutcome:
    m = next(x for x in model.measured if x.label == label)
    tok_s = model.unchanged_tok_s(label)
    return PhaseOutcome(label, m.concurrency, tok_s, None, None, None, None, ())


def _unique(options: tuple[Option, ...]) -> tuple[Option, ...]:
    out: list[Option] = []
    for o in options:
        if all(o.changes != x.changes for x in out):
            out.append(o)
    return tuple(out)


def _average_gain_text(tok_s: float) -> str:
    return f"{tok_s:+.0f} tok/s on average"


def _why(best: Option, objective: str) -> str:
    held = [p.phase for p in best.phases if not p.gains and not p.loses]
    goal = {"throughput": "the most throughput over the run's phases, weighted by their duration",
            "peak": "the most throughput at the highest load level",
            "slo": "the most throughput within the SLO"}[objective]
    text = f"{goal} ({_average_gain_text(best.weighted_gain_tok_s)})"
    if objective != "peak":
        text += ", no phase loses beyond its band"
    if held:
        text += f" ({', '.join(held)} within it)"
    if best.origin.startswith("finding: "):
        text += f"; it addresses {best.origin.removeprefix('finding: ')}"
    wide = [p.extrapolation for p in best.phases if p.extrapolation]
    if wide:
        text += f"; {wide[0]}"
    return text


def _keep_reason(trades: list[Option], objective: str, slo: Mapping[str, float], n: int,
                 closest: Option | None) -> str:
    if not trades:
        text = f"none of the {n} change sets replayed gains beyond its band at any phase"
        if closest is not None and closest.phases:
            top = max(closest.phases, key=lambda p: p.gain_ratio)
            origin = closest.origin.removeprefix("finding: ")
            change = f"; the findings' change {', '.join(c.text() for c in closest.changes)} ({origin})"
            text += (f"{change} at {top.phase}: {cannot_predict(top.decision_band_ratio)}"
                     + (f" ({top.extrapolation})" if top.extrapolation else "")
                     if not predictable(top.decision_band_ratio) else
                     f"{change} moves {top.phase} {top.gain_ratio:+.0%} against its band of "
                     f"{top.band_text()}")
            losses = [f"{p.phase} {p.gain_ratio:+.0%}" for p in closest.phases if p.loses]
            if losses:
                text += f" and costs {', '.join(losses)}"
        return text
    best = trades[0]
    if best.origin.startswith("finding: "):
        origin = best.origin.removeprefix("finding: ")
        return _keep_text(objective, f"{best.describe()} (it addresses {origin})")
    return _keep_text(objective, best.describe())


def _keep_text(objective: str, best: str) -> str:
    if objective == "slo":
        return ("no change set that gains beyond its band meets the SLO at every phase; the best "
                f"trade-off, {best}")
    if objective == "peak":
        return f"no change set gains beyond its band at the highest load level; the best trade-off, {best}"
    return ("every change that gains beyond its band costs another phase beyond its band; the best "
            f"trade-off, {best}")


Hook = Callable[[Analysis, "FittedModel | None"], "Advice | None"]


def advisor(objective: str = "throughput", slo: Mapping[str, float] | None = None) -> Hook:
    """``analyse_run``'s advise hook: from the finished analysis and the model its effects fitted
    (fitted here where none was), the advice; None where the run has no throughput to fit or the
    fit fails. Reads the findings, never edits them."""
    if objective not in OBJECTIVES:
        raise UsageError(f"--objective {objective!r}: choose from {', '.join(OBJECTIVES)}")
    if objective == "slo" and not slo:
        raise UsageError("the slo objective needs --slo ttft_p90=2s,itl_p90=80ms (one or both)")

    def hook(analysis: Analysis, model: FittedModel | None) -> Advice | None:
        if not any(pm.throughput_tok_s for pm in analysis.metrics):
            return None
        if model is None:
            try:
                model = fit_model(analysis)
            except GputraceError:
                return None
        advice, _ = search(model, analysis.findings, objective, slo,
                           {pm.label: pm.duration_s for pm in analysis.metrics})
        return advice

    return hook
