"""What a finding's change is predicted to do: data the what-if produces beside the findings
(keyed by ``Finding.key``), never written into them. The report renders it from here."""

from __future__ import annotations

from dataclasses import dataclass

from gputrace.json_types import JsonObject

# A band wider than this says nothing of an effect's size, so the figure is not stated: "cannot
# predict" (a huge band is as wrong as a miss: the SGLang small-chunk run's fit carried ±277 %)
PREDICTABLE_BAND_RATIO = 0.25


def predictable(band_ratio: float) -> bool:
    """Whether a prediction with this band is stated as a figure."""
    return band_ratio <= PREDICTABLE_BAND_RATIO


def cannot_predict(band_ratio: float) -> str:
    """What is said in place of a figure whose band is wider than PREDICTABLE_BAND_RATIO."""
    return (f"cannot predict: the model's band, ±{band_ratio:.0%}, is wider than "
            f"±{PREDICTABLE_BAND_RATIO:.0%}")


@dataclass(frozen=True, slots=True)
class PhaseEffect:
    """The change at one other phase: measured, predicted under the change, and the model's replay
    of the run as it ran (None where unknown)."""

    phase: str
    concurrency: int
    measured_tok_s: float
    predicted_tok_s: float
    unchanged_tok_s: float | None

    def to_dict(self) -> JsonObject:
        return {"phase": self.phase, "concurrency": self.concurrency,
                "measured_tok_s": self.measured_tok_s, "predicted_tok_s": self.predicted_tok_s,
                "unchanged_tok_s": self.unchanged_tok_s}


@dataclass(frozen=True, slots=True)
class PredictedEffect:
    """A finding's change, run by the fitted model: the gain at its phase (against the band from
    the fit's residuals), the cost at the others, and the net gain over the run's levels."""

    phase: str
    concurrency: int
    measured_tok_s: float
    predicted_tok_s: float
    unchanged_tok_s: float | None
    band_ratio: float
    gain_ratio: float
    within_uncertainty: bool
    net_gain_tok_s: float
    other_phases: tuple[PhaseEffect, ...] = ()

    def to_dict(self) -> JsonObject:
        """As findings.json gives it (a finding's ``predicted``)."""
        return {"phase": self.phase, "concurrency": self.concurrency,
                "measured_tok_s": self.measured_tok_s, "predicted_tok_s": self.predicted_tok_s,
                "unchanged_tok_s": self.unchanged_tok_s, "band_ratio": self.band_ratio,
                "gain_ratio": self.gain_ratio, "within_uncertainty": self.within_uncertainty,
                "net_gain_tok_s": self.net_gain_tok_s,
                "other_phases": [o.to_dict() for o in self.other_phases]}

    def text(self) -> str:
        """``predicted: 248 -> 312 tok/s at C=32 (±8 %)``, the levels it costs, and a gain the model
        cannot tell from none."""
        # levels, not phase labels: a label is the run's text, the recommendation goes in a code span
        if not predictable(self.band_ratio):
            return f"predicted at C={self.concurrency}: {cannot_predict(self.band_ratio)}"
        text = (f"predicted: {self.measured_tok_s:.0f} -> {self.predicted_tok_s:.0f} tok/s at "
                f"C={self.concurrency} (±{self.band_ratio:.0%})")
        band = self.band_ratio
        if self.within_uncertainty:
            text += ", inside the model's uncertainty: no clear gain"
        elif moves(self.predicted_tok_s, self.unchanged_tok_s, self.measured_tok_s, band, up=False):
            text += "; a loss at this phase"
        costs = [f"C={o.concurrency} {o.measured_tok_s:.0f} -> {o.predicted_tok_s:.0f}"
                 for o in self.other_phases
                 if moves(o.predicted_tok_s, o.unchanged_tok_s, o.measured_tok_s, band, up=False)]
        if costs:
            text += "; costs " + ", ".join(costs) + " tok/s"
        return text


def moves(predicted_tok_s: float, unchanged_tok_s: float | None, measured_tok_s: float, band: float,
          up: bool) -> bool:
    """Whether the change itself moves a phase past its band, up or down. A prediction is
    calibrated (gputrace.whatif.predict: measured x model(change) / model(as run)), so against the
    measurement it is what the change itself moves, not the fit's offset from the run (a model
    that replayed C=4 at 49 tok/s where 90 were measured "cost" C=4 49 under any change)."""
    reference = measured_tok_s
    if not reference:
        return False
    moved = float(predicted_tok_s) / float(reference) - 1
    return moved > band if up else moved < -band
