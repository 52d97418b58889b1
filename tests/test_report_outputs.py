"""The report, compare and export commands on stores built from records."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
from analysis_synth import Level, SynthRun, build
from click.testing import CliRunner

from gputrace.cli import cli as main
from gputrace.errors import UsageError
from gputrace.report.document import SCHEMA
from gputrace.report.figures import FIGURES


def _capped(path: Path) -> Path:
    build(path, SynthRun([Level("C=1", 1, 1, [0.125] * 4, 1, 6),
                          Level("C=32", 32, 32, [0.25] * 4, 16, 6, queue=16)], pp=4))
    return path


def _fixed(path: Path) -> Path:
    build(path, SynthRun([Level("C=1", 1, 1, [0.125] * 4, 1, 6),
                          Level("C=32", 32, 32, [0.95] * 4, 8, 6)], pp=4,
                         engine={"max_running_requests": 64, "pp_max_micro_batch_size": 64}))
    return path


def test_report_writes_three_formats(tmp_path: Path) -> None:
    """report.html, report.md with PNGs beside it, findings.json with the documented keys."""
    run = _capped(tmp_path / "run")
    res = CliRunner().invoke(main, ["report", str(run), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert "microbatch_cap [C=32]" in res.output
    out = tmp_path / "out"
    doc = json.loads((out / "findings.json").read_text())
    assert doc["schema"] == SCHEMA
    assert set(doc) == {"schema", "summary", "findings", "phases", "table", "mapping", "notes"}
    assert doc["findings"][0]["cause"] == "microbatch_cap" and doc["findings"][0]["evidence"]["K"] == 16
    assert len(doc["table"]) == 2 * 4 and {"busy_fraction", "bubble_fraction"} <= set(doc["table"][0])
    md = (out / "report.md").read_text()
    for name in FIGURES:
        assert f"]({name}.png)" in md and (out / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    assert md.index("## Findings") < md.index("## Phase by stage") < md.index("## Figures")
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == len(FIGURES)


def test_report_rejects_unknown_format(tmp_path: Path) -> None:
    """An unknown --format is a usage error (exit status 2) naming the bad value."""
    run = _capped(tmp_path / "run")
    res = CliRunner().invoke(main, ["report", str(run), "--format", "html,pdf"])
    assert isinstance(res.exception, UsageError) and "pdf" in str(res.exception)
    assert res.exception.exit_code == 2


def test_compare_shows_gain_and_resolved(tmp_path: Path) -> None:
    """compare: throughput per matching phase and the cap finding resolved."""
    a, b = _capped(tmp_path / "a"), _fixed(tmp_path / "b")
    res = CliRunner().invoke(main, ["compare", str(a), str(b), "--out", str(tmp_path / "cmp")])
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    c32 = next(p for p in doc["phases"] if p["label"] == "C=32")
    assert c32["findings_resolved"] == ["microbatch_cap"] and c32["findings_new"] == []
    assert c32["throughput_gain"] is not None
    assert "| C=32 |" in res.output
    assert (tmp_path / "cmp" / "compare.html").read_text().startswith("<!DOCTYPE html>")


def test_export_parquet_and_perfetto(tmp_path: Path) -> None:
    """Parquet per table; the trace has counter tracks per stage and one slice per phase."""
    run = _capped(tmp_path / "run")
    res = CliRunner().invoke(main, ["export", str(run), "--parquet", str(tmp_path / "pq"),
                                    "--perfetto", str(tmp_path / "trace.json")])
    assert res.exit_code == 0, res.output
    assert pq.read_table(tmp_path / "pq" / "gpu_samples.parquet").num_rows == 4 * 120
    trace = json.loads((tmp_path / "trace.json").read_text())
    ev = trace["traceEvents"]
    slices = [e for e in ev if e["ph"] == "X"]
    assert [e["name"] for e in slices] == ["C=1", "C=32"] and slices[0]["dur"] == 6e6
    tracks = {(e["pid"], e["name"]) for e in ev if e["ph"] == "C"}
    assert tracks == {(s + 1, n) for s in range(4) for n in ("utilization", "running requests", "power_w")}
    names = {e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    assert {"stage 0", "stage 3"} <= names
    res = CliRunner().invoke(main, ["export", str(run)])
    assert isinstance(res.exception, UsageError)
