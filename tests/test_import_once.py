"""`gputrace import` adds each record once, by content ([robust] #45, "import exactly once"): a log
imported again after it grew adds only its new lines, the same log compressed adds none, and an
overlapping request file adds only the requests the run lacks; the summary says how many were
there already. Real files, the real CLI in its own process."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest
from helpers import gputrace_process

from gputrace.store import Store

ENGINES = Path(__file__).parent / "data" / "engines"
SGLANG = ENGINES / "sglang-0.5.23-pp2" / "default"
VLLM = ENGINES / "vllm-0.32.0-pp2" / "default"
AIPERF = Path(__file__).parent / "import_data" / "aiperf_profile_export.jsonl"
LOGS = [("--sglang-log", SGLANG / "engine.log", ()),
        ("--vllm-log", VLLM / "engine.log", ("--date", "2026-12-01"))]
LOG_IDS = ["sglang", "vllm"]
# an engine log's rows as the analysis reads them: everything but the source's name
_EVENT_ROWS = ("SELECT * EXCLUDE (source) FROM scheduler_events ORDER BY line_no")
_CONFIG_ROWS = ("SELECT * EXCLUDE (source) FROM engine_configs ORDER BY line_no")


def _first_lines(data: bytes, at_least: int) -> bytes:
    """The log's bytes up to the first newline past ``at_least`` (as the file was when it had
    grown that far; a log's stray carriage returns stay as they are)."""
    return data[: data.index(b"\n", at_least) + 1]


def _import(run: Path, *argv: str) -> str:
    proc = gputrace_process("import", "--run", str(run), *argv)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _rows(run: Path, query: str) -> list[tuple[object, ...]]:
    with Store.open(run, read_only=True) as store:
        return store.sql(query)


def _log_rows(run: Path) -> tuple[list[tuple[object, ...]], list[tuple[object, ...]]]:
    return _rows(run, _EVENT_ROWS), _rows(run, _CONFIG_ROWS)


@pytest.mark.parametrize(("option", "source", "extra"), LOGS, ids=LOG_IDS)
def test_a_grown_log_imported_again_adds_only_its_new_lines(tmp_path: Path, option: str, source: Path,
                                                            extra: tuple[str, ...]) -> None:
    """Half the log imported, then the whole log at the same path: the run holds what one import
    of the whole log gives (it held 5,350 events for SGLang's 3,502), and the second summary
    says how many of its rows were there already."""
    data = source.read_bytes()
    log = tmp_path / "engine.log"
    log.write_bytes(_first_lines(data, len(data) // 2))
    run = tmp_path / "run"
    _import(run, option, str(log), *extra)
    half_events, half_configs = (len(rows) for rows in _log_rows(run))
    assert half_events > 0
    shutil.copy(source, log)
    second = _import(run, option, str(log), *extra)

    whole = tmp_path / "whole"
    _import(whole, option, str(source), *extra)
    events, configs = _log_rows(whole)
    assert _log_rows(run) == (events, configs)
    added = f"; {len(events) - half_events} events, {len(configs) - half_configs} configuration records"
    assert added in second
    assert f"; {half_events} events, {half_configs} configuration records already present" in second


@pytest.mark.parametrize(("option", "source", "extra"), LOGS, ids=LOG_IDS)
def test_the_same_log_plain_and_gzipped_goes_in_once(tmp_path: Path, option: str, source: Path,
                                                     extra: tuple[str, ...]) -> None:
    """A log, then the same log as .gz (its bytes differ, its content does not): nothing added
    (SGLang's 3,502 events became 7,004), the second summary names the first file; and the other
    way round."""
    gz = tmp_path / (source.name + ".gz")
    gz.write_bytes(gzip.compress(source.read_bytes()))
    for name, order in (("plain-first", (source, gz)), ("gz-first", (gz, source))):
        run = tmp_path / name
        _import(run, option, str(order[0]), *extra)
        once = _log_rows(run)
        again = _import(run, option, str(order[1]), *extra)
        assert _log_rows(run) == once
        assert (f"0 events, 0 configuration records; {len(once[0])} events, {len(once[1])} configuration "
                f"records already present (this log's content came first in {order[0].resolve()})") in again


def test_a_gzipped_half_then_the_grown_plain_log_adds_the_rest(tmp_path: Path) -> None:
    """The rotated, compressed first half and then the live log that holds it all: once each line."""
    data = SGLANG.joinpath("engine.log").read_bytes()
    gz = tmp_path / "engine.log.1.gz"
    gz.write_bytes(gzip.compress(_first_lines(data, len(data) // 3)))
    run, whole = tmp_path / "run", tmp_path / "whole"
    _import(run, "--sglang-log", str(gz))
    _import(run, "--sglang-log", str(SGLANG / "engine.log"))
    _import(whole, "--sglang-log", str(SGLANG / "engine.log"))
    assert _log_rows(run) == _log_rows(whole)


def test_another_log_written_at_the_same_path_is_imported_whole(tmp_path: Path) -> None:
    """Content, not the path, says which lines a run holds: a different log later written where
    the first was goes in whole, under its own source, so neither loses a line to the other's
    line numbers."""
    log = tmp_path / "engine.log"
    first, second = SGLANG / "engine.log", ENGINES / "sglang-0.5.23-pp2" / "interval2" / "engine.log"
    counts = []
    for source in (first, second):
        _import(tmp_path / f"alone-{source.parent.name}", "--sglang-log", str(source))
        counts.append(len(_rows(tmp_path / f"alone-{source.parent.name}", _EVENT_ROWS)))
        shutil.copy(source, log)
        out = _import(tmp_path / "run", "--sglang-log", str(log))
        assert "already present" not in out
    sources = _rows(tmp_path / "run", "SELECT source, count(*) FROM scheduler_events GROUP BY 1")
    assert sorted(n for _, n in sources) == sorted(counts) and len(sources) == 2


def _requests_and_markers(run: Path) -> tuple[int, int]:
    with Store.open(run, read_only=True) as store:
        return store.count("requests"), store.count("markers")


def test_half_a_requests_file_then_all_of_it_adds_each_request_once(tmp_path: Path) -> None:
    """Half of gputrace's requests.jsonl, then all of it: 128 requests and 4 markers (there were
    192 and 6), and the summary says 64 requests and 2 markers were present."""
    lines = SGLANG.joinpath("requests.jsonl").read_text().splitlines(keepends=True)
    half = tmp_path / "half.jsonl"
    half.write_text("".join(lines[:66]))
    run = tmp_path / "run"
    assert "64 requests, 2 markers imported" in _import(run, "--requests", str(half))
    second = _import(run, "--requests", str(SGLANG / "requests.jsonl"))
    assert _requests_and_markers(run) == (128, 4)
    assert second.strip().endswith("64 requests, 2 markers imported; 2 markers, 64 requests already present")


def _aiperf_requests() -> list[str]:
    """The export's request lines (its last line is one cut short: a bad row, left out here)."""
    lines = [line + "\n" for line in AIPERF.read_text().split("\n") if line]
    return [line for line in lines if line.rstrip().endswith("}")]


def test_overlapping_aiperf_exports_add_each_request_once(tmp_path: Path) -> None:
    """Two AIPerf exports that share two requests (by x_request_id and start): each request once."""
    lines = _aiperf_requests()
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(lines[:4]))
    b.write_text("".join(lines[2:]))
    run = tmp_path / "run"
    _import(run, "--aiperf", str(a))
    second = _import(run, "--aiperf", str(b))
    ids = {json.loads(line)["metadata"]["x_request_id"] for line in lines}
    assert _requests_and_markers(run)[0] == len(ids) == len(lines) == 6
    assert second.strip().endswith("2 requests imported; 2 requests already present")


def test_requests_with_one_fallback_id_but_other_starts_are_all_kept(tmp_path: Path) -> None:
    """A request is known by its id and its start: AIPerf's fallback id is the session number,
    which two different exports share, so requests that only share it are different requests."""
    first = json.loads(_aiperf_requests()[0])
    later = json.loads(_aiperf_requests()[0])
    for obj in (first, later):
        del obj["metadata"]["x_request_id"]
    later["metadata"]["request_start_ns"] += 10**9
    later["metadata"]["request_end_ns"] += 10**9
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(json.dumps(first) + "\n")
    b.write_text(json.dumps(later) + "\n")
    run = tmp_path / "run"
    _import(run, "--aiperf", str(a))
    assert "already present" not in _import(run, "--aiperf", str(b))
    assert _requests_and_markers(run)[0] == 2
