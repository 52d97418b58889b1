"""compare.html and compare.md as a reader sees them ([ux]): what the change resolved and brought
in words, both runs' key figures side by side, links to both reports, a warning when a run is
compared with itself, and no CSS the page does not use."""

from __future__ import annotations

import dataclasses
import html
import json
import re
import shutil
from pathlib import Path

from analysis_synth import capped_run, fixed_run
from helpers import cli

from gputrace.report.compare_render import CSS

_capped, _fixed = capped_run, fixed_run


def _compare(a: Path, b: Path, out: Path) -> tuple[str, str]:
    """(compare.html, the command's stdout and stderr)."""
    res = cli(["compare", str(a), str(b), "--out", str(out)])
    assert res.exit_code == 0, res.output
    return (out / "compare.html").read_text(), res.output


def _classes_used(page: str) -> set[str]:
    return {c for attr in re.findall(r"class='([^']*)'", page) for c in attr.split()}


def test_compare_says_what_changed_and_shows_both_runs(tmp_path: Path) -> None:
    """The cap resolved in C=32 is said in words with run A's own summary; tok/s and bubble of
    both runs sit side by side; both reports are linked relative to the page; the top finding
    of each run is named."""
    a, b = _capped(tmp_path / "a"), _fixed(tmp_path / "b")
    for run in (a, b):
        assert cli(["report", str(run), "--format", "html"]).exit_code == 0
    page, out = _compare(a, b, tmp_path / "cmp")
    assert "Resolved in phase C=32: microbatch_cap (run A: every micro-batch holds K = 4" in page
    assert "<th>tok/s A</th><th>tok/s B</th>" in page and "<th>bubble A</th><th>bubble B</th>" in page
    doc = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    c32 = next(p for p in doc["phases"] if p["label"] == "C=32")
    assert f"<td>{c32['throughput_tok_s_a']:.1f}</td><td>{c32['throughput_tok_s_b']:.1f}</td>" in page
    assert "href='../a/report/report.html'" in page and "href='../b/report/report.html'" in page
    assert doc["top_finding_a"]["cause"] == "microbatch_cap" and "microbatch_cap in phase C=32" in page
    assert "warning" not in _classes_used(page) and doc["same_run"] is None
    assert "- Resolved in phase C=32: microbatch_cap" in out

    back, _ = _compare(b, a, tmp_path / "back")  # the other way round, the cap is new
    assert "New in phase C=32: microbatch_cap (run B: every micro-batch holds K = 4" in back
    assert "change: --pp-max-micro-batch-size" in back


def test_a_run_compared_with_itself_is_warned_about(tmp_path: Path) -> None:
    """The same directory, or a copy of it (same run id), gives a warning on the page, in
    compare.md and on stderr."""
    a = _capped(tmp_path / "a")
    page, out = _compare(a, a, tmp_path / "self")
    assert "class='warning'>Warning: run A and run B are the same run directory" in page
    assert "warning: run A and run B are the same run directory" in out
    md = (tmp_path / "self" / "compare.md").read_text()
    assert "**Warning: run A and run B are the same run directory" in md
    shutil.copytree(a, tmp_path / "copy")
    page, _ = _compare(a, tmp_path / "copy", tmp_path / "copied")
    assert "Warning: run A and run B are the same run id (" in page
    assert "no report yet: <code>gputrace report" in page  # no report written for these


def test_compare_css_holds_only_what_the_pages_use(tmp_path: Path) -> None:
    """Each class the stylesheet styles is on an element of some compare page (resolved, new,
    same-run warning); there are no image or finding-box rules left over from the report."""
    a, b = _capped(tmp_path / "a"), _fixed(tmp_path / "b")
    used: set[str] = set()
    for x, y, name in ((a, b, "ab"), (b, a, "ba"), (a, a, "aa")):
        page, _ = _compare(x, y, tmp_path / name)
        assert f"<style>{CSS}</style>" in page
        used |= _classes_used(page)
    styled = set(re.findall(r"\.([a-z][\w-]*)", CSS))
    assert styled and styled <= used, styled - used
    assert ".finding" not in CSS and ".verdict" not in CSS
    assert all("id='fig-compare'" in _compare(x, y, tmp_path / f"{name}-fig")[0]
               for x, y, name in ((a, b, "ab"), (a, a, "aa")))  # the figure A beside B: img is used


def test_the_top_finding_is_the_one_the_report_leads_with(tmp_path: Path) -> None:
    """compare's 'top finding' is the finding the run's report opens its verdict with: a light
    level's 'offer more requests' ranked first gives way to the deployment change (the demo's
    compare named run A's C=1 load finding where its report led with K at C=32)."""
    from gputrace.analyse import analyse_run
    from gputrace.analysis.compare import top_finding
    from gputrace.analysis.diagnose import Finding
    from gputrace.report.render import verdict
    from gputrace.store import Store
    from gputrace.vocabulary import Change

    with Store.open(_capped(tmp_path / "a"), read_only=True) as store:
        analysis = analyse_run(store, effects=False)
    load = Finding("pipeline_underfilled", "C=1", [0, 1, 2, 3], {}, 0.7, "offer at least 4 requests",
                   "1 micro-batch for 4 stages", change=Change.of_flag("concurrency", 4))
    analysis = dataclasses.replace(analysis, findings=(load, *analysis.findings))
    top = top_finding(analysis)
    assert top is not None and top["cause"] == "microbatch_cap" and top["phase"] == "C=32"
    opening = verdict(analysis)
    assert opening.startswith("No advice (the what-if model could not be fitted to this run); the top "
                              f"finding, microbatch_cap in phase C=32: {top['summary']};")


def test_what_changed_says_the_throughput_that_moved(tmp_path: Path) -> None:
    """'What changed' says B's throughput against A's per phase that moved more than 5 %, in
    words, on the page and in compare.md (a 40 % regression stood only in the gain column)."""
    a, b = _capped(tmp_path / "a"), _fixed(tmp_path / "b")
    page, _ = _compare(a, b, tmp_path / "cmp")
    doc = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    gains = {p["label"]: p["throughput_gain"] for p in doc["phases"]}
    moved = [f"{k} x{g:.2f}" for k, g in gains.items() if abs(g - 1) > 0.05]
    alike = [k for k, g in gains.items() if abs(g - 1) <= 0.05]
    assert moved and alike, gains  # the fix lifts C=32; C=1 is the same in both
    line = f"Throughput, B against A: {', '.join(moved)}; the other phase within 5%."
    assert len(alike) == 1 and f"<p>{line}</p>" in page
    what_changed = page[page.index("<h2>What changed</h2>"):page.index("<h2>The two runs</h2>")]
    assert line in what_changed
    assert f"\n{line}\n" in (tmp_path / "cmp" / "compare.md").read_text()
    same, _ = _compare(a, a, tmp_path / "self")
    assert "Throughput: B within 5% of A in every phase." in same


def test_runs_without_bubble_figures_get_no_columns_of_n_a(tmp_path: Path) -> None:
    """Two runs without GPU samples: the per-phase table has no bubble columns and the footer says
    why; runs with them keep both columns."""
    from gputrace.store import Store

    a, b = _capped(tmp_path / "a"), _fixed(tmp_path / "b")
    page, _ = _compare(a, b, tmp_path / "with")
    assert "<th>bubble A</th><th>bubble B</th>" in page and "Bubble: the mean over the stages" in page
    for run in (a, b):
        with Store.open(run) as store:
            store.sql("DELETE FROM gpu_samples")
    page, _ = _compare(a, b, tmp_path / "without")
    doc = json.loads((tmp_path / "without" / "compare.json").read_text())
    assert all(p["bubble_fraction_mean_a"] is None and p["bubble_fraction_mean_b"] is None
               for p in doc["phases"])
    assert "<th>bubble A</th>" not in page and "<td>n/a</td><td>n/a</td>" not in page
    assert "<th>phase</th><th>tok/s A</th><th>tok/s B</th><th>gain</th><th>TTFT p50 A s</th>" in page
    assert "Bubble: not in either run (no GPU samples)." in page
    md = (tmp_path / "without" / "compare.md").read_text()
    assert "| phase | tok/s A | tok/s B | gain | TTFT p50 A s | TTFT p50 B s | resolved | new |" in md


def _simulated(scenario: str, where: Path, seed: int = 0) -> Path:
    from gputrace.sim.outputs import write_store
    from gputrace.sim.virtual import run_scenario

    return write_store(run_scenario(scenario, seed), where)


def test_compare_sets_the_prediction_of_b_beside_b_measured(tmp_path: Path) -> None:
    """[whatif]: B applied A's recommendation (the simulator's microbatch-cap scenario, then its
    fix, K 2 -> 8): compare fits the simulator to A, predicts B, and sets that beside what B
    measured, per phase, naming the change and the finding of A that recommended it."""
    a, b = _simulated("microbatch-cap", tmp_path / "a"), _simulated("microbatch-fixed", tmp_path / "b")
    page, out = _compare(a, b, tmp_path / "cmp")
    assert "fitting the simulator to run A" in out
    pam = json.loads((tmp_path / "cmp" / "compare.json").read_text())["predicted_against_measured"]
    assert pam["changes"] == {"pp_max_micro_batch_size": [2, 8]} and pam["note"] is None
    assert [f["cause"] for f in pam["recommended_by"]] == ["microbatch_cap"]
    rows = {r["label"]: r for r in pam["phases"]}
    assert set(rows) == {"C=1", "C=8", "C=32", "C=64"}
    for r in rows.values():  # the simulator's own truth: the prediction holds to 10 % ([whatif] MS1)
        assert r["error"] == round(r["predicted_tok_s"] / r["measured_b_tok_s"] - 1, 4)
        assert abs(r["error"]) <= 0.10, r
    assert rows["C=64"]["measured_b_tok_s"] > 2 * rows["C=64"]["measured_a_tok_s"]  # the change moved it
    md = (tmp_path / "cmp" / "compare.md").read_text()
    assert "## Predicted against measured" in md and "B changed pp_max_micro_batch_size 2 -> 8" in md
    assert "Recommended by A's microbatch_cap in phase C=64: --pp-max-micro-batch-size 8" in md
    c64 = rows["C=64"]
    assert (f"| C=64 | {c64['measured_a_tok_s']:.1f} | {c64['predicted_tok_s']:.1f} | "
            f"{c64['measured_b_tok_s']:.1f} | {c64['error']:+.1%} |") in md
    assert "<h2>Predicted against measured</h2>" in page and f"<td>{c64['predicted_tok_s']:.1f}</td>" in page


def test_compare_of_one_deployment_says_there_is_nothing_to_predict(tmp_path: Path) -> None:
    """Two runs whose logs state the same settings: no fit is made, and the page says why there
    is no prediction; --no-predict leaves the section out."""
    a, b = _simulated("microbatch-cap", tmp_path / "a"), _simulated("microbatch-cap", tmp_path / "b", seed=1)
    page, out = _compare(a, b, tmp_path / "cmp")
    assert "fitting the simulator" not in out
    pam = json.loads((tmp_path / "cmp" / "compare.json").read_text())["predicted_against_measured"]
    assert pam["changes"] == {} and pam["phases"] == [] and "the same deployment settings" in pam["note"]
    assert "Prediction: B&#x27;s log states the same deployment settings" in page
    res = cli(["compare", str(a), str(b), "--no-predict", "--out", str(tmp_path / "no")])
    assert res.exit_code == 0, res.output
    assert "predicted_against_measured" not in json.loads((tmp_path / "no" / "compare.json").read_text())
    assert "Predicted against measured" not in (tmp_path / "no" / "compare.md").read_text()


def _phase(label: str, c: int, a: float, b: float) -> dict[str, object]:
    from gputrace.analysis.compare import phase_verdict
    return {"label": label, "target_concurrency": c, "throughput_tok_s_a": a, "throughput_tok_s_b": b,
            "throughput_gain": b / a, "verdict": phase_verdict(b / a)}


def test_the_bottom_line_says_better_worse_or_the_trade_off_at_the_peak_load() -> None:
    """One sentence: a trade-off names where B gains and where it loses and what to do at the
    highest load; worse everywhere it moved is 'revert'; better is 'keep it'; 5 % is the same."""
    from gputrace.analysis.compare import bottom_line
    trade = bottom_line([_phase("C=8", 8, 100, 109), _phase("C=32", 32, 400, 436),
                         _phase("C=64", 64, 800, 448)])
    assert trade["verdict"] == "trade-off" and trade["peak_phase"] == "C=64"
    assert trade["text"] == ("Trade-off: B gains 9 % at C<=32 and loses 44 % at C=64; at your peak load "
                             "(C=64) B is worse: revert.")
    worse = bottom_line([_phase("C=1", 1, 37, 37.2), _phase("C=32", 32, 1068, 324),
                         _phase("C=64", 64, 1686, 320)])
    assert worse["text"] == "B is worse at your peak load: revert. B loses 70-81 % at C>=32; no phase better."
    better = bottom_line([_phase("C=1", 1, 37, 37), _phase("C=32", 32, 900, 1200)])
    assert better["verdict"] == "better"
    assert better["text"].startswith("B is better: keep it. B gains 33 % at C=32")
    assert bottom_line([_phase("C=1", 1, 37, 38)])["verdict"] == "same"


def test_the_page_opens_with_the_bottom_line_and_each_phase(tmp_path: Path) -> None:
    """compare.html and compare.md say the bottom line before anything else, then each phase:
    better, worse or the same, by how much measured (and predicted from A, where it was)."""
    a, b = _capped(tmp_path / "a"), _fixed(tmp_path / "b")
    page, _ = _compare(a, b, tmp_path / "cmp")
    doc = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    text = doc["bottom_line"]["text"]
    assert doc["bottom_line"]["verdict"] == "better" and text.startswith("B is better: keep it.")
    assert page.index(f"<p class='bottom'>{text}</p>") < page.index("<h2>What changed</h2>")
    c32 = next(p for p in doc["phases"] if p["label"] == "C=32")
    line = (f"C=32: better, {c32['throughput_tok_s_a']:.0f} -> {c32['throughput_tok_s_b']:.0f} tok/s "
            f"({c32['throughput_gain'] - 1:+.0%} measured")
    assert f"<li class='better'>{html.escape(line)}" in page
    md = (tmp_path / "cmp" / "compare.md").read_text().splitlines()
    assert md[2] == f"**{text}**" and md[4].startswith("- C=")
