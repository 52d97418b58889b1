"""`analyse_run`: the one analysis of a run every command renders; immutable, with the predicted
effects and the advice beside the findings ([architecture])."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from gputrace.analyse import analyse_run
from gputrace.analysis.result import Analysis
from gputrace.report.document import build_document
from gputrace.store import Store
from gputrace.whatif.fit import FittedModel


@dataclasses.dataclass(frozen=True)
class _Keep:
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"changes": [], "reason": self.reason}


@pytest.mark.slow
def test_analysis_is_immutable_and_effects_sit_beside_the_findings(motivating_run: Path) -> None:
    """The effects are keyed by finding, the findings keep the rules' text; the advice hook sees
    the finished analysis and the model fitted for the effects, once; its answer is findings.json's
    ``advice``; neither Analysis nor Finding can be edited."""
    calls: list[tuple[Analysis, FittedModel | None]] = []

    def advise(analysis: Analysis, model: FittedModel | None) -> _Keep:
        calls.append((analysis, model))
        return _Keep("nothing clears its band")

    with Store.open(motivating_run, read_only=True) as store:
        plain = analyse_run(store, effects=False)
        a = analyse_run(store, advise=advise)
    assert not plain.effects and plain.advice is None
    (seen, model), = calls
    assert model is not None and seen.effects == a.effects
    assert a.effects and set(a.effects) <= {f.key for f in a.findings}
    for f in a.findings:
        assert "predicted:" not in f.recommendation
        effect = a.effect_of(f)
        if effect is not None:
            assert a.recommendation_of(f) == f"{f.recommendation}; {effect.text()}"
    assert {f.key for f in a.findings} == {f.key for f in plain.findings}
    doc = build_document(a)
    assert doc["advice"] == {"changes": [], "reason": "nothing clears its band"}
    assert "advice" not in build_document(plain)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.findings[0].recommendation = "edited"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.notes = ()  # type: ignore[misc]
