"""The comparison document (``compare.json``, schema ``gputrace.compare/1``, with the what-if's
``predicted_against_measured``) read as typed records: the page and its figure are drawn from the
document alone, as a compare.json on disk would be, so what they read is narrowed here, where it
enters, and a field that is absent or of another type reads as unknown (None, empty)."""

from __future__ import annotations

from dataclasses import dataclass

from gputrace.json_types import (
    JsonReadObject,
    JsonReadValue,
    as_list,
    as_number,
    as_object,
    as_objects,
    as_text,
)


def _texts(value: JsonReadValue | None) -> tuple[str, ...]:
    return tuple(item for item in as_list(value) if isinstance(item, str))


@dataclass(frozen=True, slots=True)
class FindingWords:
    """A finding as the comparison states it: its cause, phase, what it says and its change."""

    cause: str
    phase: str
    summary: str
    recommendation: str

    @classmethod
    def read(cls, d: JsonReadObject) -> FindingWords:
        return cls(*(as_text(d.get(k)) or "" for k in ("cause", "phase", "summary", "recommendation")))


def _findings(value: JsonReadValue | None) -> tuple[FindingWords, ...]:
    return tuple(FindingWords.read(d) for d in as_objects(value))


@dataclass(frozen=True, slots=True)
class ComparedPhase:
    """One phase both runs have (matched by label): A's and B's figures side by side."""

    label: str
    throughput_tok_s_a: float | None
    throughput_tok_s_b: float | None
    throughput_gain: float | None  # B over A
    verdict: str | None  # better, worse, same
    bubble_fraction_mean_a: float | None
    bubble_fraction_mean_b: float | None
    busy_fraction_a: tuple[float | None, ...]  # per stage
    busy_fraction_b: tuple[float | None, ...]
    ttft_s_p50_a: float | None
    ttft_s_p50_b: float | None
    findings_resolved: tuple[str, ...]  # causes
    findings_new: tuple[str, ...]
    resolved: tuple[FindingWords, ...]  # as A stated them
    new: tuple[FindingWords, ...]  # as B states them

    @classmethod
    def read(cls, d: JsonReadObject) -> ComparedPhase:
        def n(key: str) -> float | None:
            return as_number(d.get(key))

        def stages(key: str) -> tuple[float | None, ...]:
            return tuple(as_number(v) for v in as_list(d.get(key)))
        return cls(as_text(d.get("label")) or "", n("throughput_tok_s_a"), n("throughput_tok_s_b"),
                   n("throughput_gain"), as_text(d.get("verdict")), n("bubble_fraction_mean_a"),
                   n("bubble_fraction_mean_b"), stages("busy_fraction_a"), stages("busy_fraction_b"),
                   n("ttft_s_p50_a"), n("ttft_s_p50_b"), _texts(d.get("findings_resolved")),
                   _texts(d.get("findings_new")), _findings(d.get("resolved")), _findings(d.get("new")))


@dataclass(frozen=True, slots=True)
class PredictedPhase:
    """One phase of the prediction of B from A: A measured, B predicted, B measured."""

    label: str
    measured_a_tok_s: float | None
    predicted_tok_s: float | None
    measured_b_tok_s: float | None
    error: float | None  # predicted against B measured
    within_band: bool | None

    @classmethod
    def read(cls, d: JsonReadObject) -> PredictedPhase:
        within = d.get("within_band")
        return cls(as_text(d.get("label")) or "", as_number(d.get("measured_a_tok_s")),
                   as_number(d.get("predicted_tok_s")), as_number(d.get("measured_b_tok_s")),
                   as_number(d.get("error")), within if isinstance(within, bool) else None)


@dataclass(frozen=True, slots=True)
class SettingChange:
    """A setting B's log states otherwise than A's: its value in each (None: the default)."""

    setting: str
    value_a: JsonReadValue
    value_b: JsonReadValue


@dataclass(frozen=True, slots=True)
class Prediction:
    """The what-if's prediction of B from A (``predicted_against_measured``); ``note`` says why
    there is none where there is none."""

    note: str | None
    changes: tuple[SettingChange, ...]
    band_ratio: float | None
    recommended_by: tuple[FindingWords, ...]  # A's findings that recommended the change
    phases: tuple[PredictedPhase, ...]

    @classmethod
    def read(cls, d: JsonReadObject) -> Prediction:
        changes = as_object(d.get("changes")) or {}
        pairs = {k: as_list(v) for k, v in changes.items()}
        return cls(as_text(d.get("note")),
                   tuple(SettingChange(k, v[0], v[1]) for k, v in pairs.items() if len(v) == 2),
                   as_number(d.get("band_ratio")), _findings(d.get("recommended_by")),
                   tuple(PredictedPhase.read(p) for p in as_objects(d.get("phases"))))


@dataclass(frozen=True, slots=True)
class Comparison:
    """Run B against run A, as the page shows it."""

    run_a: str
    run_b: str
    run_a_dir: str | None
    run_b_dir: str | None
    same_run: str | None  # why A and B are one run, None where they are two
    bottom_line: str | None  # the page's first sentence (older documents have none)
    top_finding_a: FindingWords | None
    top_finding_b: FindingWords | None
    phases: tuple[ComparedPhase, ...]
    unmatched_a: tuple[str, ...]  # phase labels only in A
    unmatched_b: tuple[str, ...]
    run_resolved: tuple[FindingWords, ...]  # whole-run findings
    run_new: tuple[FindingWords, ...]
    prediction: Prediction | None

    @classmethod
    def read(cls, doc: JsonReadObject) -> Comparison:
        def top(key: str) -> FindingWords | None:
            found = as_object(doc.get(key))
            return None if found is None else FindingWords.read(found)
        bottom = as_object(doc.get("bottom_line")) or {}
        prediction = as_object(doc.get("predicted_against_measured"))
        return cls(as_text(doc.get("run_a")) or "", as_text(doc.get("run_b")) or "",
                   as_text(doc.get("run_a_dir")), as_text(doc.get("run_b_dir")),
                   as_text(doc.get("same_run")), as_text(bottom.get("text")),
                   top("top_finding_a"), top("top_finding_b"),
                   tuple(ComparedPhase.read(p) for p in as_objects(doc.get("phases"))),
                   _texts(doc.get("unmatched_a")), _texts(doc.get("unmatched_b")),
                   _findings(doc.get("run_resolved")), _findings(doc.get("run_new")),
                   None if prediction is None else Prediction.read(prediction))
