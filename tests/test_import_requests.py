"""Importers of per-request records (AIPerf, guidellm, gputrace JSONL) into a real run store.

Fixtures in tests/import_data/ are built in each tool's real output format:
- aiperf_profile_export.jsonl: AIPerf's per-request export, field for field as documented in
  ai-dynamo/aiperf docs/tutorials/working-with-profile-exports.md ("Per-Request Records (JSONL)":
  metadata.request_start_ns/request_end_ns/x_request_id/benchmark_phase, metrics as
  {"value", "unit"}, error {code, type, message}); the last line is cut short as a killed run
  leaves it.
- guidellm_0.4_benchmarks.json: GenerativeBenchmarksReport as guidellm >= 0.4 dumps it
  (vllm-project/guidellm src/guidellm/schemas/request_stats.py GenerativeRequestStats with
  info.timings from src/guidellm/schemas/info.py RequestTimings, input_metrics/output_metrics,
  requests grouped successful/incomplete/errored as in
  src/guidellm/benchmark/schemas/generative/benchmark.py, config.strategy concurrent/streams).
- guidellm_0.3_benchmarks.json: guidellm 0.3's layout (GenerativeRequestStats with
  scheduler_info.request_timings request_start/first_iteration/request_end and flat
  prompt_tokens/output_tokens; Benchmark.scheduler.strategy), from the 0.3 benchmark/benchmark.py.
- guidellm_0.2_benchmarks.json: guidellm 0.2's layout (GenerativeTextResponseStats with flat
  start_time/first_token_time/end_time, GenerativeTextErrorStats with ``error`` and null token
  times; GenerativeBenchmark.args.strategy), from the 0.2 src/guidellm/benchmark/benchmark.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gputrace.errors import ConfigError
from gputrace.imports.jsonl import write_jsonl
from gputrace.imports.request_files import (
    import_aiperf,
    import_guidellm,
    import_requests_jsonl,
    parse_aiperf,
    parse_guidellm,
    parse_requests_jsonl,
)
from gputrace.model import Marker, RequestRecord
from gputrace.store import Store

DATA = Path(__file__).parent / "import_data"


def test_aiperf_into_store(tmp_path: Path) -> None:
    """AIPerf records land as requests with ns times, TTFT, tokens and errors; the cut line is counted."""
    with Store.create(tmp_path / "run") as store:
        result = import_aiperf(store, DATA / "aiperf_profile_export.jsonl", host="bench-1", phase="C=32")
        assert result.written == {"requests": 6, "markers": 2, "gpu_samples": 0}
        assert result.bad == 1 and "not JSON" in result.problems[0]
        reqs = sorted(store.records(RequestRecord), key=lambda r: r.start_ns)
        markers = sorted(store.records(Marker), key=lambda m: m.ts_ns)
    first = reqs[0]
    assert first.request_id == "7609a2e7-aa53-4ab1-98f4-f35ecafe0000"
    assert first.start_ns == 1759813207532900363 and first.end_ns == 1759813207532900363 + 300_000_000
    assert first.first_token_ns == first.start_ns + 120_000_000
    assert (first.prompt_tokens, first.completion_tokens) == (550, 9)
    assert first.host == "bench-1" and first.source == "aiperf" and first.phase == "C=32" and first.ok
    failed = [r for r in reqs if not r.ok]
    assert len(failed) == 1 and failed[0].error is not None
    assert failed[0].error.startswith("RequestCancellationError (499)")
    assert failed[0].completion_tokens is None and failed[0].prompt_tokens == 550
    got = [(m.label, m.kind, m.target_concurrency) for m in markers]
    assert got == [("C=32", "phase", 32), ("end", "end", None)]
    assert markers[0].ts_ns == reqs[0].start_ns and markers[1].ts_ns == max(r.end_ns or 0 for r in reqs)


def test_guidellm_04_sweep(tmp_path: Path) -> None:
    """Each guidellm benchmark becomes a phase "C=streams"; errored requests keep their message."""
    parsed = parse_guidellm(DATA / "guidellm_0.4_benchmarks.json", host="bench-2")
    reqs = [r for r in parsed.records if isinstance(r, RequestRecord)]
    markers = [r for r in parsed.records if isinstance(r, Marker)]
    assert parsed.bad == 0
    assert [(m.label, m.target_concurrency) for m in markers] == [("C=2", 2), ("C=8", 8), ("end", None)]
    assert len(reqs) == 14
    ok = [r for r in reqs if r.ok]
    assert len(ok) == 12 and all(r.completion_tokens == 64 and r.prompt_tokens == 128 for r in ok)
    r0 = min(ok, key=lambda r: r.start_ns)
    assert r0.start_ns == 1764489600_000_000_000
    assert r0.first_token_ns == pytest.approx(r0.start_ns + 70_000_000, abs=1_000)
    assert r0.end_ns == pytest.approx(r0.start_ns + 1_200_000_000, abs=1_000)
    errs = [r for r in reqs if not r.ok]
    assert len(errs) == 2 and all("503 Service Unavailable" in (r.error or "") for r in errs)
    assert {r.phase for r in errs} == {"C=2", "C=8"}
    with Store.create(tmp_path / "run") as store:
        result = import_guidellm(store, DATA / "guidellm_0.4_benchmarks.json", host="bench-2")
        assert store.count("requests") == 14 and store.count("markers") == 3
    assert "14 requests, 3 markers imported" in result.summary()


def test_guidellm_03_layout() -> None:
    """guidellm 0.3's scheduler_info.request_timings layout; a synchronous benchmark is C=1."""
    parsed = parse_guidellm(DATA / "guidellm_0.3_benchmarks.json", host="h")
    reqs = [r for r in parsed.records if isinstance(r, RequestRecord)]
    assert len(reqs) == 4 and all(r.ok and r.phase == "C=1" for r in reqs)
    assert all(r.completion_tokens == 32 and r.prompt_tokens == 256 for r in reqs)
    assert all(r.first_token_ns is not None and r.first_token_ns - r.start_ns == pytest.approx(4e7, abs=1e3)
               for r in reqs)


def test_guidellm_02_layout() -> None:
    """guidellm 0.2's flat start_time/first_token_time layout; errored requests keep their error."""
    parsed = parse_guidellm(DATA / "guidellm_0.2_benchmarks.json", host="h")
    reqs = sorted((r for r in parsed.records if isinstance(r, RequestRecord)), key=lambda r: r.start_ns)
    assert parsed.bad == 0 and len(reqs) == 6 and {r.phase for r in reqs} == {"C=4"}
    ok = [r for r in reqs if r.ok]
    assert len(ok) == 5 and all(r.completion_tokens == 16 and r.prompt_tokens == 64 for r in ok)
    assert ok[0].start_ns == 1764490000_000_000_000
    assert ok[0].first_token_ns == pytest.approx(ok[0].start_ns + 60_000_000, abs=1_000)
    (bad,) = [r for r in reqs if not r.ok]
    assert bad.error == "ReadTimeout: timed out"
    assert bad.first_token_ns is None and bad.completion_tokens is None
    markers = [(m.label, m.kind, m.target_concurrency) for m in parsed.records if isinstance(m, Marker)]
    assert markers == [("C=4", "phase", 4), ("end", "end", None)]


def test_guidellm_bad_request_counted(tmp_path: Path) -> None:
    """A request entry without timings is skipped and counted, the rest imported."""
    report = json.loads((DATA / "guidellm_0.4_benchmarks.json").read_text())
    report["benchmarks"][0]["requests"]["successful"][1]["info"]["timings"] = {}
    path = tmp_path / "b.json"
    path.write_text(json.dumps(report))
    parsed = parse_guidellm(path, host="h")
    assert parsed.bad == 1 and "no request start time" in parsed.problems[0]
    assert sum(isinstance(r, RequestRecord) for r in parsed.records) == 13


def test_own_jsonl_round_trip(tmp_path: Path) -> None:
    """What `gputrace load --out` writes imports back to the same records."""
    records: list[RequestRecord | Marker] = [
        Marker(host="c", ts_ns=10, label="C=4", target_concurrency=4),
        RequestRecord(host="c", request_id="r1", start_ns=11, first_token_ns=20, end_ns=30, prompt_tokens=5,
                      completion_tokens=7, phase="C=4"),
        RequestRecord(host="c", request_id="r2", start_ns=12, end_ns=13, ok=False, error="HTTP 503: busy",
                      phase="C=4"),
        Marker(host="c", ts_ns=40, label="end", kind="end"),
    ]
    path = tmp_path / "load.jsonl"
    write_jsonl(path, records)
    with path.open("a") as fh:
        fh.write('{"type": "request", "host": "c"}\n')  # missing fields
    parsed = parse_requests_jsonl(path)
    assert parsed.records == records and parsed.bad == 1
    with Store.create(tmp_path / "run") as store:
        result = import_requests_jsonl(store, path, host="renamed")
        assert result.written["requests"] == 2 and result.written["markers"] == 2
        assert {r.host for r in store.records(RequestRecord)} == {"renamed"}


@pytest.mark.parametrize(
    ("parser", "wrong", "message"),
    [
        (parse_aiperf, "guidellm_0.4_benchmarks.json", "not an AIPerf profile_export.jsonl"),
        (parse_guidellm, "aiperf_profile_export.jsonl", "not a guidellm JSON report"),
        (parse_requests_jsonl, "aiperf_profile_export.jsonl", "not a gputrace requests JSONL"),
        (parse_guidellm, "nvidia_smi_query.csv", "not a guidellm JSON report"),
    ],
)
def test_wrong_file_type_is_one_line(parser: object, wrong: str, message: str) -> None:
    """Handing an importer another tool's file is a one-line ConfigError naming the file."""
    with pytest.raises(ConfigError) as info:
        parser(DATA / wrong, host="h")  # type: ignore[operator]
    text = str(info.value)
    assert "\n" not in text and message in text and wrong in text


def test_missing_file_is_one_line(tmp_path: Path) -> None:
    """A path that does not exist is a ConfigError, not a traceback."""
    with pytest.raises(ConfigError, match="cannot read"):
        parse_aiperf(tmp_path / "nope.jsonl", host="h")


def test_rows_with_values_no_column_holds_are_skipped_not_the_file(tmp_path: Path) -> None:
    """A requests JSONL with a start time past int64 and a lone surrogate in an id: those two rows
    are counted as bad with the reason, the good one is imported ([robust] #3)."""
    import json

    from gputrace.imports.request_files import import_requests_jsonl
    from gputrace.store import Store

    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in (
        {"type": "request", "host": "c", "request_id": "a", "start_ns": 1, "end_ns": 2},
        {"type": "request", "host": "c", "request_id": "b", "start_ns": 2**64, "end_ns": 2},
        {"type": "request", "host": "c", "request_id": "\ud800", "start_ns": 3},
    )) + "\n")
    with Store.create(tmp_path / "run") as store:
        result = import_requests_jsonl(store, path)
        assert store.count("requests") == 1
    assert result.written["requests"] == 1 and result.bad == 2
    assert any("start_ns=18446744073709551616" in p for p in result.problems)


def test_guidellm_json_nested_past_any_report_is_refused_in_one_line(tmp_path: Path) -> None:
    """A JSON file nested 100,000 deep is not a guidellm report: a ConfigError, not RecursionError."""
    from gputrace.errors import ConfigError
    from gputrace.imports.request_files import parse_guidellm

    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConfigError, match=r"not a guidellm (JSON|benchmarks) report"):
        parse_guidellm(deep, host="c")


def test_aiperf_and_guidellm_rows_no_column_holds_are_skipped_not_the_file(tmp_path: Path) -> None:
    """An AIPerf request_start_ns of 2^63 and a lone surrogate in its request id, a guidellm
    prompt_tokens of 2^63 and a lone surrogate in its request_id: each such row is one bad row
    with its reason, every other row is imported ([robust] #3: 0 rows, `unexpected OverflowError`)."""
    lines = (DATA / "aiperf_profile_export.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines[:3]]
    rows[1]["metadata"]["request_start_ns"] = 2**63
    rows[2]["metadata"]["x_request_id"] = "\ud800"
    aiperf = tmp_path / "aiperf.jsonl"
    aiperf.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    report = json.loads((DATA / "guidellm_0.4_benchmarks.json").read_text())
    successful = report["benchmarks"][0]["requests"]["successful"]
    successful[1]["prompt_tokens"] = 2**63
    successful[2]["request_id"] = "\ud800"
    guidellm = tmp_path / "guidellm.json"
    guidellm.write_text(json.dumps(report))
    with Store.create(tmp_path / "run") as store:
        first = import_aiperf(store, aiperf, host="client", phase="C=1")
        assert store.count("requests") == 1
        second = import_guidellm(store, guidellm, host="client")
        assert store.count("requests") == 1 + 14 - 2
    assert first.bad == 2 and first.written["requests"] == 1
    assert any("9223372036854775808" in p for p in first.problems)
    assert second.bad == 2 and second.written["requests"] == 14 - 2
    assert any("prompt_tokens=9223372036854775808" in p for p in second.problems)
