"""Log ingest into a run store: the vectorised fast path gives exactly the per-line grammar's
records on a file mixing every form and edge case; `gputrace import` with engine logs."""

from __future__ import annotations

import datetime as dt
import gzip
import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import shared_data
from helpers import open_paths
from hypothesis import given, settings
from hypothesis import strategies as st

from gputrace.engines import sglang
from gputrace.engines.common import METRIC_FIELDS, LogClock
from gputrace.engines.sglang import fastpath
from gputrace.errors import SourceError
from gputrace.imports import engine_log as ingest
from gputrace.imports import log_files
from gputrace.imports.engine_log import ingest_log
from gputrace.imports.report import ImportReport
from gputrace.model import EngineConfig
from gputrace.store import Store

REPO = Path(__file__).resolve().parents[1]
SGLANG_LINES = shared_data("sglang/real-lines.txt")
VLLM_LINES = SGLANG_LINES.parent.parent / "vllm" / "real-lines.txt"


def _prefix(rnd: random.Random) -> str:
    ts = f"2026-{rnd.randint(1, 12):02d}-{rnd.randint(1, 28):02d} {rnd.randint(0, 23):02d}:" \
         f"{rnd.randint(0, 59):02d}:{rnd.randint(0, 59):02d}"
    if rnd.random() < 0.2:
        ts += f".{rnd.randint(0, 999):03d}"
    names = rnd.sample(["DP", "PP", "ATTN_CP", "MOE_DP", "TP", "EP"], rnd.randint(0, 4))
    return "[" + ts + "".join(f" {n}{rnd.randint(0, 15)}" for n in names) + "]"


def _number(rnd: random.Random, decimal: bool) -> str:
    if rnd.random() < 0.02:  # too long for exact arithmetic: must go the per-line way
        return "9" * 25 + (".5" if decimal else "")
    if decimal:
        return f"{rnd.uniform(0, 5000):.{rnd.choice([1, 2, 3])}f}"
    return str(rnd.randint(0, 10**rnd.randint(1, 7))).zfill(rnd.choice([1, 1, 1, 3]))


def _batch_line(rnd: random.Random) -> str:
    graph = f"{rnd.choice(['cuda', 'cpu', 'npu', 'musa'])} graph: {rnd.choice(['True', 'False'])}"
    it = f" [{rnd.randint(0, 999)}]" if rnd.random() < 0.2 else ""
    sep = rnd.choice([",", ",", "."])  # "Decode batch." from 2024-06 to 2025-10
    spec = rnd.choice(["", "", f"accept len: {_number(rnd, True)}, ",
                       f"accept len: {_number(rnd, True)}, accept rate: {_number(rnd, True)}, ",
                       "accept len: 3, "])  # speculative decoding (an integer one goes per line)
    usage = f"token usage: {_number(rnd, True)}"
    if rnd.random() < 0.7:
        graph_flag = rnd.choice([f"{graph}, "] * 4 + [""])  # no graph flag before 2025-05
        pools = rnd.choice([f"#token: {_number(rnd, False)}, {usage}"] * 3 + [  # hybrid models:
            f"#full token: {_number(rnd, False)}, full {usage}, #swa token: {_number(rnd, False)}, "
            f"swa {usage}", f"#full token: {_number(rnd, False)}, full {usage}, mamba num: 2"])
        body = (f"Decode batch{it}{sep} #running-req: {_number(rnd, False)}, {pools}, {spec}{graph_flag}"
                f"gen throughput (token/s): {_number(rnd, True)}, "
                f"#queue-req: {_number(rnd, False)}" + rnd.choice(["", "", ", "]))
    else:
        pending = f", #pending-token: {_number(rnd, False)}" if rnd.random() < 0.5 else ""
        # before 2026 prefill lines could end after the queue (or pending tokens), often with ", "
        tail = rnd.choice([f", {graph}, input throughput (token/s): {_number(rnd, True)}"] * 3
                          + ["", ", ", f", {graph}"])
        body = (f"Prefill batch{it}{sep} #new-seq: {_number(rnd, False)}, #new-token: {_number(rnd, False)}, "
                f"#cached-token: {_number(rnd, False)}, "
                + rnd.choice([usage] * 3 + [f"full {usage}, swa {usage}", f"full {usage}, mamba {usage}",
                                            f"full {usage}"]) + ", "
                f"#running-req: {_number(rnd, False)}, #queue-req: {_number(rnd, False)}{pending}{tail}")
    return f"{_prefix(rnd)} {body}"


_RUNTIME_PREFIXES = ["2026-06-24T15:38:02.123456789Z stdout F ", "2026-06-24T15:38:02Z ",
                     "\t2026-06-24T15:38:02.5-0700  stderr  P  ", "2026-06-24T15:38:02Z stdoutF ",
                     "2026-06-24 15:38:02Z stdout F "]


def _mixed_log(path: Path, n_lines: int, seed: int, runtime_prefix: bool = False) -> None:
    """Current-form lines with every variable part, plus every other kind of line around them;
    with ``runtime_prefix``, most lines in a container runtime's prefix (some malformed)."""
    rnd = random.Random(seed)
    real = [line for line in SGLANG_LINES.read_text(encoding="utf-8").split("\n") if line]
    odd = ["[2026-13-40 25:00:00 PP1] Decode batch, #running-req: 1, #token: 2, token usage: 0.10, "
           "cuda graph: True, gen throughput (token/s): 1.00, #queue-req: 0",
           "", "   ",
           "[2026-01-01 00:00:00] server_args=ServerArgs(pp_size=8, tp_size=1, max_running_requests=64)"]
    with path.open("wb") as out:
        for i in range(n_lines):
            r = rnd.random()
            if r < 0.8:
                line = _batch_line(rnd)
            elif r < 0.9:
                line = rnd.choice(real)
            else:
                line = rnd.choice(odd)
            if runtime_prefix and rnd.random() < 0.95:
                line = rnd.choice(_RUNTIME_PREFIXES[:2] * 8 + _RUNTIME_PREFIXES[2:]) + line
            data = line.encode()
            if rnd.random() < 0.01:
                data += b"\r"
            if rnd.random() < 0.002:
                data = b"\xff\xfe" + data  # invalid UTF-8 sends its whole chunk the per-line way
            out.write(data + (b"\n" if i < n_lines - 1 else b""))


@pytest.mark.parametrize(("tz", "row_group_rows", "runtime_prefix"), [
    ("UTC", None, False), ("Europe/Berlin", None, False), ("UTC", 97, False), ("UTC", None, True)])
def test_fast_path_equals_per_line_grammar(tmp_path: Path, tz: str, row_group_rows: int | None,
                                           runtime_prefix: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every event, count and configuration record is the same with and without the fast path,
    also when fast rows are appended in small row groups cut across chunks, and in a container's
    log (its runtime's prefix on most lines, a few malformed)."""
    batching = {}
    if row_group_rows is not None:  # many appends of whole groups, the rest carried over
        monkeypatch.setattr(ingest, "ROW_GROUP_ROWS", row_group_rows)
        batching = {"batch_rows": 250}
    log = tmp_path / "mixed.log"
    _mixed_log(log, 6000, seed=7, runtime_prefix=runtime_prefix)
    tables = {}
    stats = {}
    for fast in (True, False):
        with Store.create(tmp_path / f"run-{fast}") as store:
            stats[fast] = ingest_log(store, log, host="n0", tz=tz, fast=fast, chunk_bytes=16384,
                                     **batching)
            tables[fast] = store.arrow("scheduler_events", order_by="line_no")
            tables[f"cfg-{fast}"] = store.arrow("engine_configs", order_by="line_no")
    assert stats[True].fast_path_lines > 2000  # of 4,800 batch lines; edge forms go per line
    assert stats[True].as_dict() == stats[False].as_dict()
    assert tables[True].num_rows == stats[True].events_written > 4000
    for name in tables[False].column_names:
        assert tables[True].column(name).equals(tables[False].column(name)), name
    assert tables["cfg-True"].equals(tables["cfg-False"])


def test_ingest_counts_and_records(tmp_path: Path) -> None:
    """Ingesting the real lines writes one event per batch line and the configuration records."""
    with Store.create(tmp_path / "run") as store:
        stats = ingest_log(store, SGLANG_LINES, host="n0", source="sglang.log")
        assert stats.as_dict() == {
            "path": str(SGLANG_LINES), "source": "sglang.log", "lines": 103,
            "recognised": {"prefill": 43, "decode": 30, "config": 2, "stats": 0},
            "unrecognised": 28, "events_written": 73, "configs_written": 2}
        configs = store.records(EngineConfig)
        assert sorted(c.line_no for c in configs) == [29, 30]
        assert {c.max_running_requests for c in configs} == {2049}
        rows = store.sql("SELECT pp_rank, running_req FROM scheduler_events WHERE pp_rank IS NOT NULL "
                         "ORDER BY line_no")
        assert rows == [(0, 1), (1, 1), (2, 1), (3, 1), (0, 3), (1, 3)]


def test_missing_log_is_a_source_error(tmp_path: Path) -> None:
    """A log that cannot be read raises SourceError naming the file."""
    with Store.create(tmp_path / "run") as store, pytest.raises(SourceError, match=r"nope\.log"):
        ingest_log(store, tmp_path / "nope.log", host="n0")


def test_import_command_with_engine_logs(tmp_path: Path) -> None:
    """`gputrace import` creates the run, reads .gz and plain logs of both engines, and appends; the
    same log again, plain after its .gz, adds nothing ([robust] import exactly once)."""
    gz = tmp_path / "sglang.log.gz"
    gz.write_bytes(gzip.compress(SGLANG_LINES.read_bytes()))
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "gputrace", "import", "--run", str(run), "--host", "node-3",
           "--sglang-log", str(gz), "--vllm-log", str(VLLM_LINES), "--date", "2025-01-01"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    summary = f"sglang log {gz}: 103 lines, recognised prefill 43, decode 30, config 2, unrecognised 28"
    assert summary in out.stdout
    again = subprocess.run([*cmd[:8], "--sglang-log", str(SGLANG_LINES)], capture_output=True, text=True,
                           timeout=60)
    assert again.returncode == 0, again.stderr
    assert "73 events, 2 configuration records already present" in again.stdout, again.stdout
    with Store.open(run, read_only=True) as store:
        by_engine = dict(store.sql("SELECT engine, count(*) FROM scheduler_events GROUP BY 1"))
        assert by_engine == {"sglang": 73, "vllm": 12}
        assert store.sql("SELECT DISTINCT host FROM scheduler_events") == [("node-3",)]
        vllm_first = store.sql("SELECT min(log_ts_ns) FROM scheduler_events WHERE engine = 'vllm'")
        # The earliest vLLM stamp is "01-22 18:27:20"; its year comes from --date.
        assert vllm_first == [(int(dt.datetime(2025, 1, 22, 18, 27, 20, tzinfo=dt.UTC).timestamp()) * 10**9,)]
        assert store.count("engine_configs") == 2


_CURRENT_FORMS = [
    "[2026-06-24 15:38:02 PP3] Decode batch, #running-req: 12, #token: 998080, token usage: 0.59, "
    "cuda graph: True, gen throughput (token/s): 205.21, #queue-req: 0",
    "[2026-06-24 15:38:02.123 DP1 PP0 TP2] Decode batch [7], #running-req: 1, #token: 98, token usage: 0.00, "
    "npu graph: False, gen throughput (token/s): 5.5, #queue-req: 3, ",
    "[2026-04-05 20:02:51] Prefill batch, #new-seq: 1, #new-token: 158, #cached-token: 0, token usage: 0.08, "
    "#running-req: 31, #queue-req: 0, cuda graph: True, input throughput (token/s): 559.53",
    "[2026-08-23 09:06:04 TP0 EP0] Prefill batch [3], #new-seq: 1, #new-token: 8192, #cached-token: 0, "
    "token usage: 0.01, #running-req: 0, #queue-req: 0, #pending-token: 157704, musa graph: False, "
    "input throughput (token/s): 824.28",
    "[2025-05-31 18:31:21 DP0 TP0] Decode batch. #running-req: 8, #token: 37217, token usage: 0.13, "
    "accept len: 2.90, accept rate: 0.71, cuda graph: True, gen throughput (token/s): 171.01, "
    "#queue-req: 0, ",
    "[2025-09-03 18:33:18 TP0] Prefill batch. #new-seq: 1, #new-token: 103, #cached-token: 1, "
    "token usage: 0.00, #running-req: 0, #queue-req: 0, ",
    "[2024-11-29 10:28:26 TP0] Decode batch. #running-req: 3, #token: 6144, token usage: 0.01, "
    "gen throughput (token/s): 19.65, #queue-req: 70",
    "[2026-08-23 09:05:37 TP0 EP0] Decode batch, #running-req: 1, #full token: 165376, full token usage: "
    "0.02, #swa token: 768, swa token usage: 0.00, accept len: 5.30, accept rate: 0.86, cuda graph: True, "
    "gen throughput (token/s): 167.04, #queue-req: 0",
    "[2026-07-04 04:31:24 TP0] Prefill batch, #new-seq: 12, #new-token: 43008, #cached-token: 0, full "
    "token usage: 0.14, mamba usage: 0.20, #running-req: 1, #queue-req: 97, #pending-token: 109585, "
    "npu graph: False, input throughput (token/s): 15734.14",
    "2026-06-24T15:38:02.123456789Z stdout F [2026-06-24 15:38:02 PP3] Decode batch, #running-req: 12, "
    "#token: 998080, token usage: 0.59, cuda graph: True, gen throughput (token/s): 205.21, #queue-req: 0",
]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(_CURRENT_FORMS), st.integers(0, 400), st.integers(0, 6),
                          st.text(alphabet=st.sampled_from(list("0123456789.,: []#-PTDEx\r")), max_size=6)),
                min_size=1, max_size=8))
def test_fast_path_agrees_line_by_line(edits: list[tuple[str, int, int, str]]) -> None:
    """On current-form lines cut and overwritten at random, every line the fast path takes reads as
    the per-line grammar reads it, and every line it rejects outright is no scheduler line."""
    lines = []
    for line, at, cut, insert in edits:
        at = min(at, len(line))
        lines.append(line[:at] + insert + line[at + cut:])
    chunk = "\n".join(line.replace("\n", " ") for line in lines).encode() + b"\n"
    clock = LogClock(tz="Europe/Berlin")
    result = fastpath.scan_chunk(chunk, 0, clock)
    texts = chunk.decode().split("\n")[:-1]
    taken = result.columns["line_no"].to_pylist() if result.n_fast else []
    left = {offset for offset, _ in result.leftovers}
    assert len(taken) + len(left) + result.n_rejected == len(texts) == result.n_lines
    for row, line_no in enumerate(taken):
        expected = sglang.parse_line(texts[line_no], clock)
        assert expected is not None, texts[line_no]
        got = {name: result.columns[name][row].as_py() for name in result.columns}
        assert got["kind"] == expected.kind
        assert (got["log_ts_ns"], got["ts_resolution_ns"]) == (expected.log_ts_ns, expected.ts_resolution_ns)
        for name in ("dp_rank", "pp_rank", "tp_rank", "ep_rank"):
            assert got[name] == getattr(expected, name), name
        for name, value in got.items():
            if name in METRIC_FIELDS:
                assert value == expected.values.get(name), (name, texts[line_no])
    for offset, text in enumerate(texts):
        if offset not in left and offset not in set(taken):
            assert sglang.parse_line(text, clock) is None, text


def _decode_log(tmp_path: Path, lines: int, compressed: bool) -> tuple[str, Path]:
    """An SGLang log of ``lines`` decode lines (gzipped as sched.log.gz if ``compressed``)."""
    text = "".join(f"[2026-06-24 15:38:{i % 60:02d} PP{i % 8}] Decode batch, #running-req: 8, #token: "
                   f"{i}, token usage: 0.01, cuda graph: True, gen throughput (token/s): 250.00, "
                   "#queue-req: 24, \n" for i in range(lines))
    log = tmp_path / ("sched.log.gz" if compressed else "sched.log")
    log.write_bytes(gzip.compress(text.encode()) if compressed else text.encode())
    return text, log


@pytest.mark.parametrize("compressed", [False, True])
@pytest.mark.parametrize("ledger", [False, True])
def test_an_imported_log_is_closed_after_the_import(tmp_path: Path, compressed: bool, ledger: bool) -> None:
    """Importing a log leaves no file open, a .gz included (gzip.GzipFile does not close the file
    it is handed), with or without the ledger's hash reading beside it."""
    text, log = _decode_log(tmp_path, 100, compressed)
    hashed: list[int] = []
    with log_files.open_log(log, (lambda block: hashed.append(len(block))) if ledger else None) as stream:
        assert stream.read().decode() == text
        assert str(log) in open_paths()
    assert str(log) not in open_paths()
    assert not ledger or sum(hashed) == log.stat().st_size
    with Store.create(tmp_path / "run") as store:
        assert ingest_log(store, log, host="node0").events_written == 100
    assert str(log) not in open_paths()


@pytest.mark.parametrize("compressed", [False, True])
def test_progress_reports_the_file_read_so_far(tmp_path: Path, compressed: bool) -> None:
    """on_progress gets the bytes of the file read so far, rising chunk by chunk to its size
    (compressed bytes for a .gz); `gputrace import --progress` draws the bar and imports the same."""
    _, log = _decode_log(tmp_path, 20_000, compressed)
    seen: list[int] = []
    with Store.create(tmp_path / "run") as store:
        stats = ingest_log(store, log, host="node0", chunk_bytes=64 << 10, on_progress=seen.append)
    assert stats.events_written == 20_000
    assert len(seen) >= 3 and seen == sorted(seen) and seen[-1] == log.stat().st_size
    done = subprocess.run([sys.executable, "-m", "gputrace", "import", "--run", str(tmp_path / "cli"),
                           "--sglang-log", str(log), "--progress"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "20000 events" in done.stdout


REAL_ENGINE_SGLANG_LOGS = sorted((Path(__file__).parent / "data" / "engines").glob("sglang-*/*/engine.log"))


def _same_tables_both_ways(tmp_path: Path, log: Path, **options: object) -> dict[bool, ImportReport]:
    """Ingest ``log`` with and without the fast path: the stored events and configuration records
    are identical, column by column, and so are the counts. The two reports, by ``fast``."""
    tables = {}
    stats = {}
    for fast in (True, False):
        with Store.create(tmp_path / f"run-{fast}") as store:
            stats[fast] = ingest_log(store, log, host="n0", fast=fast, **options)  # type: ignore[arg-type]
            tables[fast] = store.arrow("scheduler_events", order_by="line_no")
            tables[f"cfg-{fast}"] = store.arrow("engine_configs", order_by="line_no")
    assert stats[True].as_dict() == stats[False].as_dict()
    assert tables[True].num_rows == stats[True].events_written
    for name in tables[False].column_names:
        assert tables[True].column(name).equals(tables[False].column(name)), name
    assert tables["cfg-True"].equals(tables["cfg-False"])
    return stats


@pytest.mark.parametrize("log", REAL_ENGINE_SGLANG_LOGS,
                         ids=lambda p: f"{p.parent.parent.name}-{p.parent.name}")
def test_fast_path_equals_per_line_grammar_on_a_real_engine_log(tmp_path: Path, log: Path) -> None:
    """A real SGLang 0.5.23 log (tests/data/engines/) ingests to the same events and configuration
    records with and without the fast path, and its batch lines take the fast path."""
    stats = _same_tables_both_ways(tmp_path, log, chunk_bytes=65536)
    # interval2 was recorded on a saturated machine: 90 batch lines, the others thousands
    assert stats[True].fast_path_lines >= 0.9 * stats[True].events_written > 50
    assert stats[True].written["engine_configs"] >= 1


def test_fast_path_equals_per_line_grammar_on_the_real_lines(tmp_path: Path) -> None:
    """The real SGLang lines collected from many versions (shared data: sglang/real-lines.txt), as
    one log and gzipped: the same tables both ways."""
    stats = _same_tables_both_ways(tmp_path / "plain", SGLANG_LINES, chunk_bytes=4096)
    assert stats[True].fast_path_lines > 10 and stats[True].events_written > stats[True].fast_path_lines
    compressed = tmp_path / "real-lines.txt.gz"
    compressed.write_bytes(gzip.compress(SGLANG_LINES.read_bytes()))
    gzipped = _same_tables_both_ways(tmp_path / "gz", compressed)
    assert gzipped[True].events_written == stats[True].events_written


def test_fast_path_equals_per_line_grammar_on_the_bench_log(tmp_path: Path) -> None:
    """bench/ingest.py's log (SGLang's current format at PP8: startup, per-stage decode and prefill
    lines, HTTP access lines, KV-pool warnings), 30,000 lines across chunks and row groups: the same
    tables both ways, its batch lines all on the fast path."""
    spec = importlib.util.spec_from_file_location("bench_ingest", REPO / "bench" / "ingest.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    log = tmp_path / "pp8.log"
    bench.write_pp8_log(log, 30_000, seed=3)
    stats = _same_tables_both_ways(tmp_path, log, chunk_bytes=1 << 20, batch_rows=4096)
    assert stats[True].fast_path_lines == stats[True].events_written > 25_000
    assert stats[True].written["engine_configs"] == 9


def test_a_line_past_the_cap_is_cut_and_memory_stays_bounded() -> None:
    """read_chunks on a stream with a 50 KB line and no newline in 200 KB: the long lines are cut
    at max_line_bytes and the rest of them skipped; no chunk grows past chunk + cap ([robust] #13:
    a 2 GB file without newlines grew past 1.9 GB)."""
    import io

    from gputrace.imports.log_files import chunk_lines, read_chunks

    good = b"[2026-01-01 00:00:00 PP0] Decode batch, #running-req: 1, #queue-req: 0\n"
    data = good + b"x" * 50_000 + b"\n" + good + b"y" * 200_000 + good
    chunks = list(read_chunks(io.BytesIO(data), chunk_bytes=4096, max_line_bytes=1000))
    assert max(len(c) for c in chunks) <= 4096 + 1000 + 1
    lines = [line for c in chunks for line in chunk_lines(c)]
    assert lines[0] == good.decode().rstrip("\n") and lines[1] == "x" * 1000 and lines[2] == lines[0]
    assert lines[3] == "y" * 1000 and len(lines) == 4  # the last good line is in the skipped tail


_RSS_SCRIPT = """
import json, resource, sys
from gputrace.imports.engine_log import ingest_log
from gputrace.store import Store
with Store.create(sys.argv[1]) as store:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    stats = ingest_log(store, sys.argv[2], host="n0", engine=sys.argv[3])
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    print(json.dumps({"grown_kib": grown, "lines": stats.lines, "events": stats.events_written,
                      "line_nos": [n for (n,) in store.sql("SELECT line_no FROM scheduler_events")]}))
"""


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize(("blank_bytes", "compressed"), [(16 << 20, False), (64 << 20, True)])
def test_a_file_of_blank_lines_is_read_in_bounded_memory(tmp_path: Path, engine: str, blank_bytes: int,
                                                         compressed: bool) -> None:
    """16 MB of blank lines, and a gzip of 64 MB of newlines, each with one batch line after them:
    memory grows by under 200 MB and the line is read, numbered after every blank one ([robust]
    #13: 16 MB of blank lines took 2.3 GB, a 1 GB gzip of newlines 2.5 GB and 20 minutes)."""
    good = {"sglang": "[2026-01-02 03:04:05 PP0] Decode batch, #running-req: 3, #token: 7, "
                      "token usage: 0.25, cuda graph: True, gen throughput (token/s): 1.00, #queue-req: 0\n",
            "vllm": "INFO 12-01 09:01:54 [loggers.py:335] Engine 000: Avg prompt throughput: 1.0 tokens/s, "
                    "Avg generation throughput: 2.0 tokens/s, Running: 3 reqs, Waiting: 0 reqs, "
                    "GPU KV cache usage: 5.0%, Prefix cache hit rate: 0.0%\n"}[engine]
    log = tmp_path / ("blank.log.gz" if compressed else "blank.log")
    blanks = b"\n" * (16 << 20)
    with (gzip.open(log, "wb", compresslevel=1) if compressed else log.open("wb")) as out:
        for _ in range(blank_bytes // len(blanks)):
            out.write(blanks)
        out.write(good.encode())
    out_ = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(tmp_path / "run"), str(log), engine],
                          capture_output=True, text=True, timeout=300)
    assert out_.returncode == 0, out_.stderr[-2000:]
    figures = json.loads(out_.stdout)
    assert figures["lines"] == blank_bytes + 1
    assert figures["events"] == 1 and figures["line_nos"] == [blank_bytes + 1]
    assert figures["grown_kib"] < 200 * 1024, figures["grown_kib"]


def test_a_file_without_newlines_is_said_to_have_lines_cut(tmp_path: Path) -> None:
    """A 3 MiB line across 1 MiB chunks before a batch line is cut at 1 MiB and counted in the
    summary, the batch line read; `import` of a file with no newline at all says its one line was
    cut ([robust] #13: the 2 GB file ended in an empty MemoryError)."""
    log = tmp_path / "long.log"
    log.write_bytes(b"x" * (3 << 20) + b"\n[2026-01-02 03:04:05 PP0] Decode batch, #running-req: 3, "
                    b"#token: 7, token usage: 0.25, cuda graph: True, gen throughput (token/s): 1.00, "
                    b"#queue-req: 0\n")
    with Store.create(tmp_path / "run") as store:
        stats = ingest_log(store, log, host="n0", chunk_bytes=1 << 20)
    assert (stats.lines, stats.lines_cut, stats.events_written) == (2, 1, 1)
    assert stats.summary().endswith("; 1 lines longer than 1 MiB cut there")
    flat = tmp_path / "flat.log"
    flat.write_bytes(b"y" * (3 << 20))
    out = subprocess.run([sys.executable, "-m", "gputrace", "import", "--run", str(tmp_path / "run2"),
                          "--sglang-log", str(flat)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == (
        f"gputrace: error: {flat}: no sglang line recognised in its 1 lines, 1 of them past 1 MiB and "
        "cut: is it the engine's log (a vllm log goes in with --vllm-log)?")
