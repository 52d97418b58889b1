"""[ux] The report's first screen holds one answer: the advice (a change, or keep with its reason
and the best trade-off named as such) in one sentence, directly under it the per-stage busy
heatmap and the per-phase throughput chart (measured against predicted, with the band), then the
per-phase table. The findings follow as the evidence, each change as "what it would do", never as
a next step; the details are folded. Checked on a run whose advice is a change and one whose
advice is to keep the settings, in report.html and report.md."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from html import unescape
from pathlib import Path

import pytest
from analysis_synth import capped_run, fixed_run
from helpers import cli

RECOMMENDATION = re.compile(r"Set --|Keep the current settings|Next step|Verdict:|change: ")
"""What reads as an instruction: the advice's two forms, and the old verdict's and findings' ones."""


def _report(tmp_path: Path, build: Callable[[Path], Path]) -> tuple[dict, str, str]:  # type: ignore[type-arg]
    run = build(tmp_path / "run")
    res = cli(["report", str(run), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    out = tmp_path / "out"
    return (json.loads((out / "findings.json").read_text()), (out / "report.html").read_text(),
            (out / "report.md").read_text())


@pytest.mark.parametrize(("build", "keep"), [(fixed_run, False), (capped_run, True)],
                         ids=["advice-is-a-change", "advice-is-keep"])
def test_the_first_screen_holds_one_recommendation_and_the_heatmap(
        tmp_path: Path, build: Callable[[Path], Path], keep: bool) -> None:
    doc, html, md = _report(tmp_path, build)
    advice = doc["advice"]
    assert (not advice["changes"]) is keep, advice["sentence"]  # the run is the kind this case needs
    sentence = f"Advice: {advice['sentence']}"
    expected = "Keep the current settings" if keep else "Set --"

    # HTML: the first screen is the section before the per-phase table, and nothing else precedes it
    body = html[html.index("<body>"):]
    first = unescape(body[body.index("<section class='first-screen'>"):body.index("</section>")])
    assert body.index("</section>") < body.index("<h2>Per phase</h2>") < body.index("Findings: the evidence")
    assert "<table" not in body[:body.index("<h2>Per phase</h2>")]  # no table before the picture
    assert first.count("class='answer'") == 1 and f"class='answer'>{sentence}<" in first
    assert [m.group() for m in RECOMMENDATION.finditer(first)] == [expected]
    if keep:  # the best trade-off is named as such, not as advice
        assert "the best trade-off, --" in first or "the findings' change --" in first
    assert first.index("class='answer'") < first.index("id='fig-busy_heatmap'") < \
        first.index("id='fig-phase_throughput'")
    # the findings are the evidence: their changes say what they would do, never a next step
    assert "Next step" not in html and "Verdict:" not in html
    evidence = body[body.index("Findings: the evidence"):]
    causes = [f for f in doc["findings"] if f["cause"] != "cannot_tell"]
    assert causes and evidence.count("what its change would do: ") == len(causes)
    # rules, thresholds, stage mapping and the raw stage table are folded
    for title in ("Phase by stage", "Stage mapping", "Rules and thresholds"):
        assert f"<details><summary>{title}</summary>" in body

    # Markdown: the first lines up to the per-phase table
    head = md[:md.index("## Per phase")]
    assert [m.group() for m in RECOMMENDATION.finditer(head)] == [expected]
    assert f"**{sentence}**" in head
    assert head.index(sentence) < head.index("(busy_heatmap.png)") < head.index("(phase_throughput.png)")
    assert "Next step" not in md and "Verdict:" not in md
    assert md.index("## Per phase") < md.index("## Findings: the evidence") < md.index("<details>")


def test_a_finding_says_what_it_costs_and_what_its_change_would_do_per_phase(tmp_path: Path) -> None:
    """Each finding: the stage-time its stages idled in its phase, and its own change's predicted
    effect (the what-if's), with the band; this synthetic run's fit carries a band of about ±66 %,
    so the effect is "cannot predict" with that band, no figure ([prefill] Build; the figures of a
    narrow band: tests/test_whatif_noise_band.py)."""
    doc, _, md = _report(tmp_path, capped_run)
    finding = next(f for f in doc["findings"] if f["cause"] == "microbatch_cap")
    pred = finding["predicted"]
    evidence = md[md.index("## Findings: the evidence"):]
    assert "costs: stages 0, 1, 2, 3 idled " in evidence and " of phase C=32 while requests" in evidence
    line = next(x for x in evidence.splitlines() if "what its change would do" in x)
    assert pred["band_ratio"] > 0.25, pred
    said = f"C={pred['concurrency']}: cannot predict: the model's band, ±{pred['band_ratio']:.0%}, is wider"
    assert said + " than ±25%" in line, line
    assert f"-> {pred['predicted_tok_s']:.0f} tok/s" not in line
