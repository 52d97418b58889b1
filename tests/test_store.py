"""The run store: round trips, schema versions, and survival of a SIGKILL mid-append."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import SmallDisk

from gputrace.backoff import Backoff
from gputrace.errors import SchemaVersionError, StoreError
from gputrace.model import ClockProbe, GpuSample, Marker, SchedulerEvent
from gputrace.store import SCHEMA_VERSION, BatchingWriter, Store


def test_records_round_trip(tmp_path: Path) -> None:
    """Records come back equal, None stays None."""
    samples = [GpuSample(host="h", gpu_index=i, ts_ns=10 + i, utilization_ratio=0.5, power_w=None)
               for i in range(3)]
    with Store.create(tmp_path / "run") as store:
        store.append(samples)
        store.append([Marker(host="h", ts_ns=5, label="C=8", target_concurrency=8)])
    with Store.open(tmp_path / "run", read_only=True) as store:
        assert store.records(GpuSample) == samples
        assert store.records(Marker)[0].label == "C=8"


def test_columns_and_nan_as_null(tmp_path: Path) -> None:
    """Columnar appends store NaN as NULL and read back as NaN; absent columns take defaults."""
    with Store.create(tmp_path / "run") as store:
        store.append_columns("gpu_samples", {
            "host": ["a", "a"], "gpu_index": np.array([0, 1]), "ts_ns": np.array([1, 2]),
            "utilization_ratio": np.array([0.25, np.nan]),
        })
        cols = store.columns("gpu_samples")
        assert cols["utilization_ratio"][0] == 0.25 and np.isnan(cols["utilization_ratio"][1])
        assert list(cols["lost"]) == [False, False]
        assert store.sql("SELECT count(*) FROM gpu_samples WHERE utilization_ratio IS NULL") == [(1,)]


def test_unknown_column_refused(tmp_path: Path) -> None:
    """A column the table lacks is an error naming it."""
    with Store.create(tmp_path / "run") as store, pytest.raises(StoreError, match="bogus"):
        store.append_columns("gpu_samples", {"bogus": [1]})


def test_newer_schema_refused(tmp_path: Path) -> None:
    """A store written by a newer schema fails with a message that says so."""
    Store.create(tmp_path / "run").close()
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    meta["schema_version"] = SCHEMA_VERSION + 1
    (tmp_path / "run" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(SchemaVersionError, match="upgrade gputrace"):
        Store.open(tmp_path / "run")


def test_not_a_run(tmp_path: Path) -> None:
    """Opening a directory that is not a run says so."""
    with pytest.raises(StoreError, match="not a gputrace run"):
        Store.open(tmp_path)


def test_meta_extra_merges(tmp_path: Path) -> None:
    """update_meta merges extra and persists."""
    with Store.create(tmp_path / "run", extra={"a": 1}) as store:
        store.update_meta(extra={"b": 2})
    with Store.open(tmp_path / "run") as store:
        assert store.meta.extra == {"a": 1, "b": 2}


def test_batching_writer_flushes_all_types(tmp_path: Path) -> None:
    """The batching writer appends every buffered type on flush."""
    with Store.create(tmp_path / "run") as store:
        writer = BatchingWriter(store, flush_s=0)
        writer.add(GpuSample(host="h", gpu_index=0, ts_ns=1))
        writer.add(SchedulerEvent(host="h", source="log", engine="sglang", kind="decode", line_no=1))
        writer.add(ClockProbe(host="h", local_send_ns=0, remote_ns=5, local_recv_ns=10))
        writer.maybe_flush()
        assert (store.count("gpu_samples"), store.count("scheduler_events"),
                store.count("clock_probes")) == (1, 1, 1)


_WRITER = r"""
import sys
from gputrace.model import GpuSample
from gputrace.store import Store
store = Store.create(sys.argv[1], exist_ok=True)
start = int(sys.argv[2])
batch = 0
while True:
    rows = [GpuSample(host="h", gpu_index=g, ts_ns=start + batch, seq=start + batch,
                      utilization_ratio=0.5) for g in range(200)]
    store.append(rows)
    print(start + batch, flush=True)  # printed only after the append returned
    batch += 1
"""


def _run_writer_until_killed(run: Path, start: int, delay_s: float) -> list[int]:
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(run), str(start)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    first = proc.stdout.readline()  # the kill lands mid-stream, not during interpreter start-up
    time.sleep(delay_s)
    proc.send_signal(signal.SIGKILL)
    out, _ = proc.communicate(timeout=30)
    return [int(line) for line in (first + out).split()]


def test_sigkill_mid_append_keeps_every_returned_batch(tmp_path: Path) -> None:
    """Killed at random points many times, every batch acknowledged before the kill is kept and
    appending continues on the same store."""
    rng = random.Random(1234)
    run = tmp_path / "run"
    acknowledged: list[int] = []
    start = 0
    for _ in range(12):
        done = _run_writer_until_killed(run, start, rng.uniform(0.0, 0.8))
        acknowledged += done
        with Store.open(run, read_only=True) as store:
            seqs = {r[0] for r in store.sql("SELECT DISTINCT seq FROM gpu_samples")}
            per_batch = dict(store.sql("SELECT seq, count(*) FROM gpu_samples GROUP BY seq"))
        missing = set(acknowledged) - seqs
        assert not missing, f"acknowledged batches lost: {sorted(missing)[:5]}"
        assert all(n == 200 for n in per_batch.values()), "a batch was half-written"
        start += 100_000
    assert len(acknowledged) > 12


def test_constant_column(tmp_path: Path) -> None:
    """A scalar stands for a constant column in a columnar append."""
    with Store.create(tmp_path / "run") as store:
        store.append_columns("gpu_samples", {"host": "n0", "gpu_index": 3, "ts_ns": np.arange(4)})
        assert store.sql("SELECT host, gpu_index, count(*) FROM gpu_samples GROUP BY ALL") == [("n0", 3, 4)]


def test_reads_after_count(tmp_path: Path) -> None:
    """count() leaves no open result behind: reads on the same connection work after it."""
    with Store.create(tmp_path / "run") as store:
        store.append([Marker(host="h", ts_ns=1, label="C=1")])
        assert store.count("markers") == 1
        assert store.records(Marker)[0].label == "C=1"
        assert len(store.columns("markers")["ts_ns"]) == 1


def test_a_table_added_later_reads_empty_in_an_older_run(tmp_path: Path) -> None:
    """A run written before a table joined the schema opens: read-only the table is empty (in
    memory only, the file untouched), writable it is created."""
    with Store.create(tmp_path / "old") as store:
        store.sql("DROP TABLE load_samples")
    with Store.open(tmp_path / "old", read_only=True) as store:
        assert store.count("load_samples") == 0
    with Store.open(tmp_path / "old", read_only=True) as store:  # still not in the file
        assert store.sql("SELECT count(*) FROM duckdb_tables() WHERE table_name = 'load_samples' "
                         "AND NOT temporary") == [(0,)]
    with Store.open(tmp_path / "old") as store:
        assert store.count("load_samples") == 0
    with Store.open(tmp_path / "old", read_only=True) as store:
        assert store.sql("SELECT count(*) FROM duckdb_tables() WHERE table_name = 'load_samples' "
                         "AND NOT temporary") == [(1,)]


def test_row_groups_are_attached_at_their_size_and_odd_paths_open(tmp_path: Path) -> None:
    """The file is attached with ROW_GROUP_ROWS (DuckDB does not keep it in the file), so a
    100,000-row append fills whole groups of that size, in any session; a directory name with a
    quote and spaces opens."""
    from gputrace.store import ROW_GROUP_ROWS

    run = tmp_path / "it's a run"
    n = 100_000
    for _ in range(2):  # the second append comes from a new session on the same file
        with Store.open(run) if run.exists() else Store.create(run) as store:
            store.append_columns("gpu_samples", {"host": "node0", "gpu_index": np.zeros(n, dtype=np.int64),
                                                 "ts_ns": np.arange(n, dtype=np.int64)})
    with Store.open(run, read_only=True) as store:
        assert store.count("gpu_samples") == 2 * n
        sizes = store.sql("SELECT row_group_id, max(count) FROM pragma_storage_info('gpu_samples') "
                          "WHERE column_name = 'ts_ns' GROUP BY 1 ORDER BY 1")
    assert max(size for _, size in sizes) == ROW_GROUP_ROWS == 65_536


def test_a_run_being_written_is_named_as_such(tmp_path: Path) -> None:
    """Reading a run another process still writes (a running collector) says so in one line,
    with that process's id and what to do."""
    with Store.create(tmp_path / "live"):
        code = (f"from gputrace.store import Store\nStore.open({str(tmp_path / 'live')!r}, read_only=True)")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert f"being written by process {os.getpid()}" in last and "Ctrl-C" in last, last


BAD_MARKERS = [  # what reached the store in the wild ([robust] #1)
    Marker("c", 1, "x", target_concurrency=True),  # type: ignore[arg-type]
    Marker("c", 1, "x", target_concurrency=2**63),
    Marker("c", 2**63, "x"),
    Marker("c", 1, "\ud800"),
]


def test_one_bad_value_is_set_aside_and_writing_goes_on(tmp_path: Path) -> None:
    """A record whose value does not fit its column (a bool count, an integer past int64, a lone
    surrogate) is set aside: counted, kept in rejects.ndjson with the reason, handed to on_reject;
    the good records of its batch and every later batch are written."""
    seen: list[str] = []
    with Store.create(tmp_path / "run") as store:
        writer = BatchingWriter(store, flush_s=0, on_reject=lambda record, reason: seen.append(reason))
        for i, bad in enumerate(BAD_MARKERS):
            writer.add(Marker("c", 10 + i, f"good-{i}"))
            writer.add(bad)
            writer.add(GpuSample("h", 0, 100 + i, utilization_ratio=0.5))
            writer.flush()
        writer.add(Marker("c", 99, "after"))
        writer.flush()
        assert store.count("markers") == len(BAD_MARKERS) + 1
        assert store.count("gpu_samples") == len(BAD_MARKERS)
    assert writer.rejected == {"Marker": len(BAD_MARKERS)} and len(seen) == len(BAD_MARKERS)
    rejects = [json.loads(line) for line in (tmp_path / "run" / "rejects.ndjson").read_text().splitlines()]
    assert [r["type"] for r in rejects] == ["Marker"] * len(BAD_MARKERS)
    assert "target_concurrency=True" in rejects[0]["reason"]
    assert "ts_ns=9223372036854775808" in rejects[2]["reason"]
    assert "label='\\ud800'" in rejects[3]["record"]  # kept as ASCII: the file itself must be writable


def test_append_of_a_bad_value_says_which_column(tmp_path: Path) -> None:
    """Store.append raises RecordError (a StoreError) for a value its column cannot hold."""
    from gputrace.errors import RecordError

    with Store.create(tmp_path / "run") as store, pytest.raises(RecordError, match="markers"):
        store.append([Marker("c", 1, "x", target_concurrency=2**63)])


def test_the_readme_query_example_runs_with_the_installed_package(tmp_path: Path) -> None:
    """The reference's way to query a run with SQL (docs/store-and-monitoring.md) works with what
    `pip install` brings (the DuckDB command-line program is not among it) ([ux])."""
    readme = (Path(__file__).resolve().parents[1] / "docs" / "store-and-monitoring.md").read_text()
    start = readme.index("python -c 'import duckdb")
    command = readme[start:readme.index("'\n", start) + 1].replace("\n    ", " ")
    with Store.create(tmp_path / "runs" / "NAME") as store:
        store.append([GpuSample("h", 0, 1, utilization_ratio=0.25),
                      GpuSample("h", 0, 2, utilization_ratio=0.75)])
    code = command.removeprefix("python -c ").strip("'")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "0.5" in out.stdout


@pytest.mark.parametrize(("meta", "message"), [
    ([1, 2], "a JSON object is expected, found list"),
    ({"schema_version": 1, "created_ns": 1, "gputrace_version": "x"}, "name missing"),
    ({"schema_version": 1, "created_ns": 1, "gputrace_version": "x", "name": "r", "topology": [1]},
     "topology must be a JSON object"),
])
def test_a_broken_meta_json_is_one_clear_error(tmp_path: Path, meta: object, message: str) -> None:
    """meta.json that is an array, lacks its name or has a topology that is not an object: a
    StoreError naming the file and what is wrong (it was `unexpected AttributeError/TypeError`)."""
    with Store.create(tmp_path / "run"):
        pass
    (tmp_path / "run" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(StoreError, match=message):
        Store.open(tmp_path / "run")


def test_placements_that_are_not_placements_are_one_clear_error() -> None:
    """A topology whose placements are not objects with a placement's keys says which one."""
    from gputrace.topology import placements_from_meta

    with pytest.raises(StoreError, match=r"topology.placements\[1\]: not a placement"):
        placements_from_meta({"placements": [{"host": "h", "gpu_index": 0, "pp_rank": 0}, 1]})


def _samples(first: int, n: int) -> list[GpuSample]:
    return [GpuSample(host="h", gpu_index=0, ts_ns=i, seq=i, utilization_ratio=0.5)
            for i in range(first, first + n)]


_FAST_RETRY = Backoff(initial_s=0.01, max_s=0.05)


def _flush_until_writing(writer: BatchingWriter, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while writer.write_error is not None and time.monotonic() < deadline:
        writer.maybe_flush()
        time.sleep(0.01)
    assert writer.write_error is None, f"still not writing after {timeout_s} s: {writer.write_error}"


def test_a_full_disk_keeps_the_rows_and_writes_them_when_space_returns(small_disk: SmallDisk) -> None:
    """[robust] #2: on a full disk the writer keeps its rows, says why and retries with back-off
    (the first failed commit ended it for good); once space returns the backlog is written."""
    with Store.create(small_disk.root / "run") as store:
        writer = BatchingWriter(store, flush_s=0, retry=_FAST_RETRY)
        writer.add_many(_samples(0, 1000))
        assert writer.flush()
        small_disk.fill()
        writer.add_many(_samples(1000, 20_000))
        assert not writer.flush()
        for _ in range(5):  # retried on the timer, and still failing while the disk is full
            time.sleep(0.06)
            writer.maybe_flush()
        health = writer.health()
        assert health["writing"] is False
        assert "No space left on device" in health["error"]
        assert health["backlog_rows"] == 20_000 and health["dropped"] == {}
        assert store.count("gpu_samples") == 1000
        small_disk.free()
        _flush_until_writing(writer)
        assert store.count("gpu_samples") == 21_000
        writer.add_many(_samples(21_000, 10))
        assert writer.flush()
        assert store.count("gpu_samples") == 21_010
        assert [o["error"] for o in writer.outages] == [health["error"]]


def test_a_checkpoint_that_fails_on_a_full_disk_is_recovered_from(small_disk: SmallDisk) -> None:
    """A commit whose checkpoint fails invalidates DuckDB's database; the store attaches it again
    and every committed row is still there."""
    with Store.create(small_disk.root / "run") as store:
        store.sql("SET checkpoint_threshold = '100KB'")  # every commit of this size checkpoints
        writer = BatchingWriter(store, flush_s=0, retry=_FAST_RETRY)
        writer.add_many(_samples(0, 3000))
        assert writer.flush()
        small_disk.fill()
        writer.add_many(_samples(3000, 27_000))
        assert not writer.flush()
        assert writer.write_error is not None and "invalidated" in writer.write_error
        small_disk.free()
        _flush_until_writing(writer)
        assert store.count("gpu_samples") == 30_000
    with Store.open(small_disk.root / "run", read_only=True) as store:
        assert store.count("gpu_samples") == 30_000


def test_rows_past_the_backlog_are_dropped_and_counted(small_disk: SmallDisk) -> None:
    """While the disk is full each type keeps at most max_backlog_rows; the rest are counted as
    dropped (never silently), and a rare type (a marker) is not crowded out by samples."""
    with Store.create(small_disk.root / "run") as store:
        writer = BatchingWriter(store, flush_s=0, max_rows=1000, max_backlog_rows=5000, retry=_FAST_RETRY)
        small_disk.fill()
        writer.add_many(_samples(0, 8000))
        writer.add(Marker(host="h", ts_ns=1, label="C=1", target_concurrency=1))
        assert writer.dropped == {"GpuSample": 3000}
        assert writer.health()["backlog_rows"] == 5001
        small_disk.free()
        _flush_until_writing(writer)
        assert store.count("gpu_samples") == 5000 and store.count("markers") == 1
        assert store.count("gpu_samples") + writer.dropped["GpuSample"] == 8000
