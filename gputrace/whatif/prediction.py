"""One level's prediction (measured against predicted, with its band), as the what-if gives it:
apart from ``predict`` so that the fitted model can cache these rows without importing the code
that makes them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

from gputrace.whatif.outcome import PhaseOutcome, PhaseOutcomeRow, relative_error


def decision_band(band_ratio: float, model_band_ratio: float | None) -> float:
    """What a predicted gain or loss must exceed to count: the model's own uncertainty on the
    effect. The stated band adds the phase's run-to-run spread, which moves one rerun's figure
    either way but not the expected effect (on CPU engines it made the advice "keep" in 8 of 10
    back-to-back repeats whose findings' change then measured +1 to +73 %)."""
    return band_ratio if model_band_ratio is None else model_band_ratio


class PhasePredictionRow(TypedDict):
    """A ``PhasePrediction`` as whatif.json gives it: the outcomes as rows, the ratios rounded."""

    label: str
    concurrency: int
    measured: PhaseOutcomeRow | None
    predicted: PhaseOutcomeRow
    unchanged: PhaseOutcomeRow | None
    band_ratio: float
    model_band_ratio: float | None
    gain_ratio: float | None
    extrapolation: str | None


@dataclass(frozen=True, slots=True)
class PhasePrediction:
    """One level: measured (None where the capture had no such level) against predicted.

    ``predicted`` is the calibrated figure, measured x model(change) / model(as run) where the
    run had the level (the model's own figure elsewhere); ``unchanged`` the calibrated model's
    replay of the run as it ran there; ``replay`` the model's raw figures under the change."""

    label: str
    concurrency: int
    measured: PhaseOutcome | None
    predicted: PhaseOutcome
    band_ratio: float
    unchanged: PhaseOutcome | None = None
    replay: PhaseOutcome | None = None
    extrapolation: str | None = None  # why the band is wide, where it is
    # the band without the phase's run-to-run spread: the model's own uncertainty on the effect
    # (its residual and the extrapolation), what a decision to change rests on
    model_band_ratio: float | None = None

    @property
    def decision_band_ratio(self) -> float:
        """What a predicted gain or loss must exceed to count (decision_band)."""
        return decision_band(self.band_ratio, self.model_band_ratio)

    @property
    def gain_ratio(self) -> float | None:
        """Predicted throughput against measured, less one."""
        m = self.measured
        return relative_error(self.predicted.throughput_tok_s, m.throughput_tok_s if m else None)

    def to_dict(self) -> PhasePredictionRow:
        return {"label": self.label, "concurrency": self.concurrency,
                "measured": self.measured.to_dict() if self.measured else None,
                "predicted": self.predicted.to_dict(),
                "unchanged": self.unchanged.to_dict() if self.unchanged else None,
                "band_ratio": round(self.band_ratio, 4),
                "model_band_ratio": (None if self.model_band_ratio is None
                                     else round(self.model_band_ratio, 4)),
                "gain_ratio": None if self.gain_ratio is None else round(self.gain_ratio, 4),
                "extrapolation": self.extrapolation}
