"""The report, compare and export commands on stores built from records."""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from analysis_synth import T0, Level, SynthRun, build, capped_run, fixed_run
from conftest import SmallDisk
from helpers import cli

from gputrace.cli import main as cli_main
from gputrace.errors import UsageError
from gputrace.report.document import SCHEMA
from gputrace.report.figures import FIGURES
from gputrace.store import Store

_capped, _fixed = capped_run, fixed_run


def test_report_writes_three_formats(tmp_path: Path) -> None:
    """report.html, report.md with PNGs beside it, findings.json with the documented keys."""
    run = _capped(tmp_path / "run")
    res = cli(["report", str(run), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert "microbatch_cap [C=32]" in res.output
    out = tmp_path / "out"
    doc = json.loads((out / "findings.json").read_text())
    assert doc["schema"] == SCHEMA
    assert set(doc) == {"schema", "summary", "findings", "advice", "phases", "table", "mapping", "notes",
                        "rules", "thresholds"}
    assert doc["findings"][0]["cause"] == "microbatch_cap" and doc["findings"][0]["evidence"]["K"] == 4
    assert len(doc["table"]) == 2 * 4 and {"busy_fraction", "bubble_fraction"} <= set(doc["table"][0])
    md = (out / "report.md").read_text()
    for name in FIGURES:
        assert f"]({name}.png)" in md and (out / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    assert md.index("## Findings") < md.index("## Figures") < md.index("<summary>Phase by stage</summary>")
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == len(FIGURES)


def test_the_report_prints_the_rules_and_their_thresholds(tmp_path: Path) -> None:
    """[diagnosis] Build: the rules are a table of small functions and their thresholds one
    dataclass; the report prints both (Markdown and HTML) and findings.json gives the thresholds the
    findings were computed with, so a changed threshold is what the report prints."""
    from dataclasses import asdict, fields

    from gputrace.analyse import analyse_run
    from gputrace.analysis.diagnose import RULES, Thresholds
    from gputrace.report.document import build_document
    from gputrace.report.render import write_report

    run = _capped(tmp_path / "run")
    res = cli(["report", str(run), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "out" / "findings.json").read_text())
    assert doc["thresholds"] == asdict(Thresholds())
    names = [r["rule"] for r in doc["rules"]]
    assert names[:len(RULES)] == [r.__name__.removeprefix("rule_") for r in RULES]
    assert {"pipeline_underfilled", "log_sampling", "cannot_tell"} <= set(names)
    assert all(r["checks"] for r in doc["rules"])  # every rule says what it checks
    md = (tmp_path / "out" / "report.md").read_text()
    html = (tmp_path / "out" / "report.html").read_text()
    assert md.index("## Figures") < md.index("<summary>Phase by stage</summary>") \
        < md.index("<summary>Rules and thresholds</summary>")
    for f in fields(Thresholds):
        value = getattr(Thresholds(), f.name)
        assert f"| {f.name} | {value} |" in md, f.name
        assert f"<td>{f.name}</td><td>{value}</td>" in html, f.name
    for name in names:
        assert f"| {name} |" in md and f"<td>{name}</td>" in html
    # the thresholds the findings came from are the ones printed
    strict = Thresholds(bubble_material=1.0)
    with Store.open(run, read_only=True) as store:
        a = analyse_run(store, effects=False, thresholds=strict)
    assert build_document(a)["thresholds"]["bubble_material"] == 1.0
    write_report(a, tmp_path / "strict", ["md"])
    assert "| bubble_material | 1.0 |" in (tmp_path / "strict" / "report.md").read_text()


def test_report_rejects_unknown_format(tmp_path: Path) -> None:
    """An unknown --format is a usage error (exit status 2) naming the bad value."""
    run = _capped(tmp_path / "run")
    res = cli(["report", str(run), "--format", "html,pdf"])
    assert isinstance(res.exception, UsageError) and "pdf" in str(res.exception)
    assert res.exception.exit_code == 2


def test_compare_shows_gain_and_resolved(tmp_path: Path) -> None:
    """compare: throughput per matching phase and the cap finding resolved."""
    a, b = _capped(tmp_path / "a"), _fixed(tmp_path / "b")
    res = cli(["compare", str(a), str(b), "--out", str(tmp_path / "cmp")])
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
    res = cli(["export", str(run), "--parquet", str(tmp_path / "pq"),
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
    res = cli(["export", str(run)])
    assert isinstance(res.exception, UsageError)


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """The console entry point as a user runs it: (exit status, stdout, stderr)."""
    with pytest.raises(SystemExit) as exited:
        cli_main([*args])
        raise SystemExit(0)
    out = capsys.readouterr()
    return int(exited.value.code or 0), out.out, out.err


def test_a_run_spanning_years_is_refused_in_one_line_and_a_window_of_it_reports(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A log appended to for two years (one stray line long before the benchmark) would need a
    grid of tens of millions of cells: the report says so in one line, with the spans, and
    reports on the window given by --start/--end (the phase running at --start begins there)."""
    run = _capped(tmp_path / "run")
    with Store.open(run) as store:
        store.sql("INSERT INTO scheduler_events (host, source, engine, kind, line_no, log_ts_ns, "
                  "ts_resolution_ns, pp_rank, running_req, queue_req) VALUES ('node0', 'old.log', "
                  f"'sglang', 'decode', 0, {T0 - 2 * 365 * 86_400 * 10**9}, 1000000000, 0, 1, 0)")
    code, _, err = _cli(capsys, "report", str(run), "--out", str(tmp_path / "out"))
    assert code == 1
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("gputrace: error:"), err
    assert "spans 730.0 days" in lines[0] and "engine log lines 2023-12-01T" in lines[0]
    assert "GPU samples 2025-11-30T" in lines[0] and "--start T --end T" in lines[0]

    start_s, end_s = T0 / 1e9 + 3, T0 / 1e9 + 12  # the last 3 s of C=1 and the whole of C=32
    res = cli(["report", str(run), "--out", str(tmp_path / "out"),
                                    "--start", f"{start_s:.3f}", "--end", f"{end_s:.3f}", "--format", "json"])
    assert res.exit_code == 0, res.output
    assert "microbatch_cap [C=32]" in res.output
    doc = json.loads((tmp_path / "out" / "findings.json").read_text())
    phases = {p["label"]: p for p in doc["phases"]}
    assert list(phases) == ["C=1", "C=32"]
    assert phases["C=1"]["start_ns"] == start_s * 1e9 and abs(phases["C=1"]["duration_s"] - 3.0) < 0.01
    assert abs(phases["C=32"]["duration_s"] - 6.0) < 0.2


def test_compare_takes_a_window_of_each_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """compare refuses the two-year run in one line naming its window flags, compares windows of
    each run (here the same run: nothing changes), and checks each window's order."""
    run = _capped(tmp_path / "run")
    with Store.open(run) as store:
        store.sql("INSERT INTO scheduler_events (host, source, engine, kind, line_no, log_ts_ns, "
                  "ts_resolution_ns, pp_rank, running_req, queue_req) VALUES ('node0', 'old.log', "
                  f"'sglang', 'decode', 0, {T0 - 2 * 365 * 86_400 * 10**9}, 1000000000, 0, 1, 0)")
    code, _, err = _cli(capsys, "compare", str(run), str(run))
    assert code == 1 and len(err.strip().splitlines()) == 1 and "--start-a/--end-a" in err, err
    start, end = f"{T0 / 1e9 + 3:.3f}", f"{T0 / 1e9 + 12:.3f}"
    res = cli(["compare", str(run), str(run), "--start-a", start, "--end-a", end,
                                    "--start-b", start, "--end-b", end, "--out", str(tmp_path / "cmp"),
                                    "--format", "json"])
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert [p["label"] for p in doc["phases"]] == ["C=1", "C=32"]
    status, _, err = _cli(capsys, "compare", str(run), str(run), "--start-b", end, "--end-b", start)
    assert status == 2 and "--end-b" in err and "is not after --start-b" in err, err


def test_window_flags_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An end before the start, a window holding no data, and --run-out without --prometheus are
    one-line errors."""
    run = _capped(tmp_path / "run")
    cases = [(["--start", "2025-11-30T07:00:10Z", "--end", "2025-11-30T07:00:05Z"], 2,
              "is not after --start"),
             (["--start", "2020-01-01T00:00:00Z", "--end", "2020-01-02T00:00:00Z"], 1, "no GPU samples"),
             (["--run-out", str(tmp_path / "x")], 2, "--run-out goes with --prometheus")]
    for args, code, text in cases:
        status, _, err = _cli(capsys, "report", str(run), *args)
        assert status == code, (args, err)
        assert err.startswith("gputrace: error:") and text in err, (args, err)


@pytest.mark.parametrize("start", ["1e30", "inf", "nan", "-1e30", "9999-12-31T23:59:59-05:00"])
def test_a_time_no_date_can_hold_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              start: str) -> None:
    """--start 1e30 was "unexpected OverflowError", exit 1: a time outside 1970-9999 is one error
    line naming the flag and the range, exit 2, and no report is written."""
    run = _capped(tmp_path / "run")
    status, _, err = _cli(capsys, "report", str(run), "--start", start, "--out", str(tmp_path / "rep"))
    assert status == 2, err
    assert err.splitlines() == [f"gputrace: error: --start {start!r}: must be from 1970 to the end of "
                                "9999 (unix seconds 0 to 253402300799)"]
    assert not (tmp_path / "rep").exists()


def test_vllm_stats_lines_are_analysed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A vLLM log alone (its periodic stats lines, MM-DD times dated at import): the phases come
    from its running + waiting requests and the engine throughput from its generation throughput;
    without --date the year is the one of the file's last change, and the import says so."""
    log = tmp_path / "vllm.log"
    lines = []
    for i in range(120):  # every 10 s: 10 min at 8 requests, then 10 min at 32 (of which 8 wait)
        minute, second = divmod(i * 10, 60)
        running, waiting, gen = (8, 0, 240.0) if i < 60 else (24, 8, 600.0)
        lines.append(f"(APIServer pid=7) INFO 06-16 10:{minute:02d}:{second:02d} [loggers.py:259] "
                     "Engine 000: "
                     f"Avg prompt throughput: 900.0 tokens/s, Avg generation throughput: {gen} tokens/s, "
                     f"Running: {running} reqs, Waiting: {waiting} reqs, GPU KV cache usage: 20.0%, "
                     "Prefix cache hit rate: 0.0%")
    log.write_text("\n".join(lines) + "\n")
    written = dt.datetime(2026, 7, 1, tzinfo=dt.UTC).timestamp()
    os.utime(log, (written, written))
    run = tmp_path / "run"
    code, _, err = _cli(capsys, "import", "--run", str(run), "--vllm-log", str(log))
    assert code == 0, err
    assert "no year: dated up to the file's last change (2026-07-01)" in err and "--date" in err, err
    with Store.open(run, read_only=True) as store:
        (first,) = store.sql("SELECT min(log_ts_ns) FROM scheduler_events")[0]
    assert dt.datetime.fromtimestamp(first / 1e9, dt.UTC) == dt.datetime(2026, 6, 16, 10, 0, tzinfo=dt.UTC)

    dated = tmp_path / "dated"
    code, _, err = _cli(capsys, "import", "--run", str(dated), "--vllm-log", str(log), "--date", "2026-06-16")
    assert code == 0, err
    code, _, err = _cli(capsys, "report", str(dated), "--format", "json")
    assert code == 0, err
    doc = json.loads((dated / "report" / "findings.json").read_text())
    levels = [(round(p["duration_s"] / 60), round(p["throughput_tok_s"])) for p in doc["phases"]]
    assert len(levels) == 2, doc["phases"]
    # each line's throughput covers the interval since the one before (the log's first covers none)
    assert [m for m, _ in levels] == [10, 10], levels
    assert all(abs(t - want) <= 0.03 * want for (_, t), want in zip(levels, (240, 600), strict=True)), levels


def test_heatmap_columns_hold_a_value_where_nvml_periods_outlast_the_cells() -> None:
    """Utilization every third cell (NVML's 1/6 s period on a finer grid): every column of the
    heatmap holds the mean of its samples, none is empty (it was drawn as idle), and long runs are
    cut to at most HEATMAP_COLUMNS columns."""
    from gputrace.report.figures import HEATMAP_COLUMNS, heatmap_columns

    n = 600
    util = np.full((2, n), np.nan)
    util[0, ::3], util[1, ::3] = 0.5, np.linspace(0, 1, n)[::3]
    t = np.arange(n) * 0.067
    cols, t_cols = heatmap_columns(util, t)
    assert not np.isnan(cols).any() and np.allclose(cols[0], 0.5)
    assert len(t_cols) == cols.shape[1] <= n // 6 and np.all(np.diff(cols[1]) > 0)
    long, _ = heatmap_columns(np.full((1, 100_000), 0.25), np.arange(100_000) * 0.1)
    assert long.shape[1] <= HEATMAP_COLUMNS and np.allclose(long, 0.25)


def test_markdown_shows_names_and_labels_as_text(tmp_path: Path) -> None:
    """A run name and marker labels holding HTML or a table's | are shown as text in report.md
    (they were embedded raw; report.html escaped them) ([robust] #11)."""
    run = tmp_path / "run"
    build(run, SynthRun([Level("<script>alert(1)</script>|C=1", 1, 1, [0.125] * 4, 1, 6),
                         Level("C=32", 32, 32, [0.9] * 4, 4, 6, queue=16)], pp=4,
                         engine={"max_running_requests": 64, "pp_max_micro_batch_size": 4}))
    meta = json.loads((run / "meta.json").read_text())
    (run / "meta.json").write_text(json.dumps({**meta, "name": "<img src=x onerror=alert(2)>"}))
    res = cli(["report", str(run), "--out", str(tmp_path / "out"), "--format", "md"])
    assert res.exit_code == 0, res.output
    md = (tmp_path / "out" / "report.md").read_text()
    assert "<script>" not in md and "<img" not in md
    assert "&lt;img src=x onerror=alert(2)>" in md and "&lt;script>alert(1)&lt;/script>\\|C=1" in md


def test_markdown_keeps_arrows_and_comparisons_as_written(tmp_path: Path) -> None:
    """report.md reads as written where no HTML could start: '->' and '<=' stay (it showed
    '-&gt;' in the verdict), an entity-like '&amp;' is escaped so it shows as typed."""
    from gputrace.report.render import _md
    assert _md("1062 -> 1282 tok/s at C<=32, a < b & c") == "1062 -> 1282 tok/s at C<=32, a < b & c"
    assert _md("&amp; <b>") == "&amp;amp; &lt;b>"


def test_the_report_opens_with_the_advice_and_shows_each_phase_once(tmp_path: Path) -> None:
    """report.md and report.html start with one sentence, the advice; the findings follow as its
    evidence, each change with what it would do (the what-if's effect); one per-phase table gives
    the prediction beside the measurement, the requests completed, failed and unfinished and
    TTFT/ITL ([ux])."""
    run = _capped(tmp_path / "run")
    res = cli(["report", str(run), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    md = (tmp_path / "out" / "report.md").read_text()
    paragraphs = md.split("\n\n")
    assert paragraphs[1].startswith("**Advice: ")  # [advisor]: the report opens with the advice
    evidence = md[md.index("## Findings: the evidence"):]
    first = next(line for line in evidence.splitlines() if line.startswith("- **"))
    assert first.startswith("- **microbatch_cap (phase C=32, ")
    would = next(line for line in evidence.splitlines() if "what its change would do" in line)
    # [whatif]'s effect: this synthetic run's band (about ±66 %) is past what a figure is stated for
    assert "--pp-max-micro" in would and "C=32: cannot predict: the model's band, ±" in would, would
    assert md.index("## Per phase") < md.index("## Findings") < md.index("## Figures")
    phases = md[md.index("## Per phase"):md.index("## Findings")]
    assert "| phase | C | in flight | tok/s | model as run tok/s | band | tok/s from | client tok/s " \
        "| input tok/s | completed | failed | unfinished | TTFT p50 s" in phases
    assert phases.count("\n| C=") == 2
    html = (tmp_path / "out" / "report.html").read_text()
    assert html.index("class='answer'>Advice: ") < html.index("<h2>Per phase</h2>")


def test_a_report_on_a_read_only_run_says_where_it_cannot_write(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`report` on a run directory on a read-only filesystem exits 2 with one line naming the
    directory and --out ([robust] #14: 'unexpected OSError' after the whole analysis); with --out
    elsewhere it reports."""
    import subprocess

    build(tmp_path / "runs" / "run", SynthRun([Level("C=8", 8, 8, [0.9, 0.9], 4, 5)], pp=2))
    view = tmp_path / "read-only"
    view.mkdir()
    bound = subprocess.run(["mount", "--bind", "-o", "ro", str(tmp_path / "runs"), str(view)],
                           capture_output=True, text=True)
    if bound.returncode != 0:
        pytest.skip(f"cannot mount a read-only view here: {bound.stderr.strip() or 'not root'}")
    try:
        run = view / "run"
        with pytest.raises(OSError):  # the view is read-only, also for root
            (run / "probe").touch()
        code, _, err = _cli(capsys, "report", str(run), "--no-progress")
        assert code == 2
        assert err.strip() == (f"gputrace: error: cannot write the report into {run}/report: "
                               "Read-only file system; give --out DIR where it can be written")
        code, _, _ = _cli(capsys, "report", str(run), "--no-progress", "--out", str(tmp_path / "out"))
        assert code == 0 and (tmp_path / "out" / "report.md").exists()
    finally:
        subprocess.run(["umount", "-l", str(view)], capture_output=True)


def test_the_verdict_names_a_deployment_change_before_a_load_to_offer(tmp_path: Path) -> None:
    """Without advice (no what-if fit), the one sentence is the findings': a light level's 'offer
    more requests' is not what a sweep that chose that level should do: it names the first finding
    whose change is to the deployment (as `gputrace demo` applies it)."""
    import dataclasses

    from gputrace.analyse import analyse_run
    from gputrace.analysis.diagnose import Finding
    from gputrace.report.render import answer
    from gputrace.vocabulary import Change

    def finding(phase: str, change: Change, rec: str) -> Finding:
        return Finding("pipeline_underfilled", phase, [0, 1], {}, 0.7, rec, f"underfilled at {phase}",
                       change=change)
    with Store.open(_capped(tmp_path / "run"), read_only=True) as store:
        analysis = analyse_run(store, effects=False)
    load = finding("C=1", Change.of_flag("concurrency", 8), "offer at least 8 requests")
    knob = finding("C=32", Change.of_flag("--pp-max-micro-batch-size", 4), "--pp-max-micro-batch-size 4")
    both = dataclasses.replace(analysis, findings=(load, knob))
    assert answer(both) == ("No advice (the what-if model could not be fitted to this run); the top finding, "
                            "pipeline_underfilled in phase C=32: underfilled at C=32; its change: "
                            "--pp-max-micro-batch-size 4.")
    # no engine setting to change: the top finding it is
    assert answer(dataclasses.replace(analysis, findings=(load,))).endswith(
        "pipeline_underfilled in phase C=1: underfilled at C=1; its change: offer at least 8 requests.")


def test_a_report_to_a_full_disk_says_where_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], small_disk: SmallDisk) -> None:
    """[robust] 14: `report --out` on a disk that has no room left exits 1 with one line naming the
    directory ('unexpected OSError: [Errno 28]' before)."""
    run = tmp_path / "run"
    build(run, SynthRun([Level("C=8", 8, 8, [0.9, 0.9], 4, 5)], pp=2))
    out = small_disk.root / "report"
    out.mkdir()
    small_disk.fill()
    filled = small_disk.filler.stat().st_size
    os.truncate(small_disk.filler, filled - 16384)  # room for the check's empty file, not a report
    code, _, err = _cli(capsys, "report", str(run), "--no-progress", "--out", str(out))
    assert code == 1, err
    assert err.strip().splitlines() == [f"gputrace: error: cannot write the report into {out}: "
                                        "No space left on device; free space there or give --out DIR"]
