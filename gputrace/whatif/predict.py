"""The fitted model under a change: per phase, what the capture measured, what the model gives
under the change, and the band from the fit's residuals. Also the engine flags findings name,
as the simulator's parameters that make them."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from gputrace.analysis.diagnose import engine_kind
from gputrace.errors import ConfigError, UsageError
from gputrace.sim.params import SimParams, make_params
from gputrace.vocabulary import Change, EngineSettings
from gputrace.whatif.fit import FittedModel, relative_error, replayed_outcomes
from gputrace.whatif.outcome import PhaseOutcome

# What a what-if may change: the deployment's settings and the load. The cost model is the fit's.
CHANGEABLE = ("pp_max_micro_batch_size", "max_running_requests", "pp_async_batch_depth",
              "chunked_prefill_size", "max_prefill_tokens", "max_total_num_tokens", "decode_log_interval",
              "stage_cost_multipliers", "pcie_bandwidth_bytes_per_s", "pcie_latency_s", "concurrency",
              "client_max_inflight", "input_tokens", "max_tokens", "think_s")
# The settings a finding's change can name that the simulator takes as they are.
SIMULATED_KNOBS = frozenset({"pp_max_micro_batch_size", "max_running_requests", "decode_log_interval",
                             "pp_async_batch_depth", "max_total_num_tokens"})
# vLLM's names for the simulator's keys (its max_num_seqs is the engine-wide admission limit)
ALIASES = {"max_num_seqs": "max_running_requests"}
# A healthy link between adjacent stages (what "use NVLink or a full PCIe link" buys): the
# simulator's default, a PCIe gen4 x16 link's payload rate.
HEALTHY_LINK = {"pcie_bandwidth_bytes_per_s": SimParams().pcie_bandwidth_bytes_per_s,
                "pcie_latency_s": SimParams().pcie_latency_s}


@dataclass(frozen=True, slots=True)
class PhasePrediction:
    """One level: measured (None where the capture had no such level) against predicted."""

    label: str
    concurrency: int
    measured: PhaseOutcome | None
    predicted: PhaseOutcome
    band_ratio: float

    @property
    def gain_ratio(self) -> float | None:
        """Predicted throughput against measured, less one."""
        m = self.measured
        return relative_error(self.predicted.throughput_tok_s, m.throughput_tok_s if m else None)

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "concurrency": self.concurrency,
                "measured": self.measured.to_dict() if self.measured else None,
                "predicted": self.predicted.to_dict(), "band_ratio": round(self.band_ratio, 4),
                "gain_ratio": None if self.gain_ratio is None else round(self.gain_ratio, 4)}


def parse_changes(items: Mapping[str, Any]) -> dict[str, Any]:
    """Check the keys of ``--set`` against what a what-if may change (vLLM's names taken as the
    simulator's)."""
    out = {}
    for key, value in items.items():
        name = ALIASES.get(key, key)
        if name not in CHANGEABLE:
            raise UsageError(f"whatif: cannot change {key!r}; valid keys: {', '.join(CHANGEABLE)}, "
                             f"{', '.join(ALIASES)}")
        out[name] = value
    return out


def check_changes(engine: EngineSettings, pp_size: int, changes: Mapping[str, Any]) -> dict[str, Any]:
    """The changes under the simulator's names; unknown keys and impossible values as one-line
    errors, before any fitting."""
    named = parse_changes(changes)
    try:
        make_params({"engine": engine_kind(engine), "pp_size": pp_size, **named})
    except ConfigError as exc:
        raise UsageError(f"whatif: {exc}; valid keys: {', '.join(CHANGEABLE)}") from None
    return named


def changed_params(model: FittedModel, changes: Mapping[str, Any]) -> SimParams:
    """The fitted parameters with ``changes`` applied and checked (one-line errors). A new layer
    split keeps the total: its shares are scaled to the fitted multipliers' sum."""
    base = model.params
    values = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    values.update(changes)
    try:
        p = make_params(values)
    except ConfigError as exc:
        raise UsageError(f"whatif: {exc}; valid keys: {', '.join(CHANGEABLE)}") from None
    if "stage_cost_multipliers" in changes and p.stage_cost_multipliers:
        total = sum(base.stage_multiplier(s) for s in range(base.pp_size))
        shares = np.asarray(p.stage_cost_multipliers, dtype=float)
        if (shares <= 0).any():
            raise UsageError("whatif: stage_cost_multipliers must be > 0")
        split = tuple(float(x) for x in shares * total / shares.sum())
        p = dataclasses.replace(p, stage_cost_multipliers=split)
    return p


def predict(model: FittedModel, changes: Mapping[str, Any]) -> list[PhasePrediction]:
    """Run the fitted model under ``changes``; pair each level with the captured phase at it."""
    p = changed_params(model, changes)
    by_level = {m.concurrency: m for m in model.measured}
    # as many levels as captured: each phase keeps its place (a finding's level raised stays its
    # phase); other levels pair with the captured phase at the same level, if any
    same_phases = len(p.concurrency) == len(model.measured)
    outcomes = replayed_outcomes(p, model.labels if same_phases else None)
    out = []
    for i, o in enumerate(outcomes):
        measured = model.measured[i] if same_phases else by_level.get(o.concurrency)
        out.append(PhasePrediction(o.label, o.concurrency, measured, o, model.uncertainty_ratio))
    return out


def even_split(model: FittedModel) -> dict[str, Any]:
    """The layer split that gives every stage the same work (the fitted total kept)."""
    return {"stage_cost_multipliers": (1.0,) * model.params.pp_size}


def finding_change(model: FittedModel, change: Change, phase: str) -> dict[str, Any] | None:
    """The simulator change that a finding's recommendation makes (its ``change``, at its
    ``phase``), None where the model cannot make it (cooling, a KV flag without a value)."""
    knob, value = change.knob, change.value
    if knob in SIMULATED_KNOBS:
        return {knob: value} if value is not None else None
    if knob == "layer_partition":
        return even_split(model)
    if knob == "link":
        return dict(HEALTHY_LINK)
    if knob == "client":  # the client keeps the level it is asked for
        return {"client_max_inflight": None}
    if knob == "concurrency" and value is not None:
        levels = list(model.params.concurrency)
        at = [i for i, m in enumerate(model.measured) if m.label == phase]
        for i in at:
            levels[i] = max(levels[i], int(value))
        return {"concurrency": tuple(levels)} if at else None
    return None
