"""`gputrace import` with load-tool and nvidia-smi files (the fixtures and their sources are
described in test_import_requests.py and test_import_smi.py)."""

from __future__ import annotations

from pathlib import Path

from helpers import gputrace_process

from gputrace.model import GpuSample, RequestRecord
from gputrace.store import Store

DATA = Path(__file__).parent / "import_data"


def test_import_every_kind_into_one_run(tmp_path: Path) -> None:
    """All five file kinds land in one store, each summarised on one line with its bad rows."""
    run = tmp_path / "run"
    proc = gputrace_process(
        "import", "--run", str(run), "--host", "node-7",
        "--aiperf", str(DATA / "aiperf_profile_export.jsonl"), "--aiperf-phase", "C=32",
        "--guidellm", str(DATA / "guidellm_0.4_benchmarks.json"),
        "--guidellm", str(DATA / "guidellm_0.3_benchmarks.json"),
        "--nvidia-smi-csv", str(DATA / "nvidia_smi_query.csv"),
        "--nvidia-smi-csv", str(DATA / "nvidia_smi_query_noheader_nounits.csv"),
        "--nvidia-smi-fields", "index,timestamp,power.draw,utilization.gpu,memory.used",
        "--nvidia-smi-dmon", str(DATA / "nvidia_smi_dmon_dt.txt"),
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 6
    assert "aiperf_profile_export.jsonl (aiperf): 6 requests, 2 markers imported; 1 bad rows" in lines[0]
    assert "(nvidia-smi-dmon): 10 gpu_samples imported; 1 bad rows skipped" in lines[5]
    with Store.open(run, read_only=True) as store:
        requests = store.records(RequestRecord)
        samples = store.records(GpuSample)
    assert len(requests) == 6 + 14 + 4 and len(samples) == 8 + 6 + 10
    assert {r.host for r in requests} == {"node-7"} and {s.host for s in samples} == {"node-7"}


def test_import_wrong_file_is_one_line(tmp_path: Path) -> None:
    """A guidellm report given as --aiperf: one error line naming the file, exit status 2."""
    proc = gputrace_process("import", "--run", str(tmp_path / "run"),
                     "--aiperf", str(DATA / "guidellm_0.4_benchmarks.json"))
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("gputrace: error: ") and "not an AIPerf profile_export.jsonl" in line


def test_a_failed_import_into_a_new_run_leaves_none_behind(tmp_path: Path) -> None:
    """`import --run NEW` that fails before importing anything removes the run it made, so the
    retry works with the same --run ([robust] #15); a run that existed is kept as it was."""
    import subprocess
    import sys

    run = tmp_path / "run"
    argv = [sys.executable, "-m", "gputrace", "import", "--run", str(run)]
    out = subprocess.run([*argv, "--sglang-log", str(tmp_path / "nope.log")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "nope.log: no such file" in out.stderr
    assert not run.exists()
    log = tmp_path / "ok.log"
    log.write_text("[2026-01-01 00:00:00 PP0] Decode batch, #running-req: 1, #token: 1, token usage: 0.00, "
                   "cuda graph: True, gen throughput (token/s): 1.00, #queue-req: 0\n")
    assert subprocess.run([*argv, "--sglang-log", str(log)], capture_output=True, timeout=60).returncode == 0
    again = subprocess.run([*argv, "--sglang-log", str(tmp_path / "nope.log")], capture_output=True,
                           timeout=60)
    assert again.returncode == 2 and (run / "meta.json").exists()


ENGINE_LOG = Path(__file__).parent / "data/engines/sglang-0.5.23-pp2/default/engine.log"


def test_a_pipe_imports_what_its_file_does(tmp_path: Path) -> None:
    """`import --sglang-log <(cat log)` ended in "unexpected OSError: Illegal seek" (and a CSV
    through a pipe in "not seekable"): a pipe is read into a temporary file and imports every
    event and sample the file itself does."""
    import subprocess
    import sys

    piped = subprocess.run(
        ["bash", "-c",
         '"$0" -m gputrace import --run "$1" --sglang-log <(cat "$2") --nvidia-smi-csv <(cat "$3")',
         sys.executable, str(tmp_path / "piped"), str(ENGINE_LOG), str(DATA / "nvidia_smi_query.csv")],
        capture_output=True, text=True, timeout=120)
    assert piped.returncode == 0, piped.stderr
    assert "unexpected" not in piped.stderr and "is a pipe: read into" in piped.stderr
    direct = gputrace_process("import", "--run", str(tmp_path / "direct"), "--sglang-log", str(ENGINE_LOG),
                              "--nvidia-smi-csv", str(DATA / "nvidia_smi_query.csv"))
    assert direct.returncode == 0, direct.stderr
    counts = []
    for run in ("piped", "direct"):
        with Store.open(tmp_path / run, read_only=True) as store:
            counts.append((store.count("scheduler_events"), len(store.records(GpuSample))))
    assert counts[0] == counts[1] and counts[0][0] > 3000 and counts[0][1] == 8


def test_a_device_is_refused_in_one_line(tmp_path: Path) -> None:
    """`import --sglang-log /dev/zero` would read forever: one line naming what it is, exit 2, no run."""
    proc = gputrace_process("import", "--run", str(tmp_path / "run"), "--sglang-log", "/dev/zero")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["gputrace: error: /dev/zero: is a character device, not a file "
                                        "(give a log or capture file, or a pipe)"]
    assert not (tmp_path / "run").exists()


def test_requests_ending_before_they_start_are_counted_and_dropped(tmp_path: Path) -> None:
    """Requests whose end precedes their start were stored without a word: each is dropped and the
    import's summary says how many; every other request and marker is stored."""
    import json

    source = Path(__file__).parent / "data/engines/sglang-0.5.23-pp2/default/requests.jsonl"
    objs = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    requests = [o for o in objs if o["type"] == "request"]
    backwards = {requests[3]["request_id"], requests[10]["request_id"]}
    for obj in requests:
        if obj["request_id"] in backwards:
            obj["end_ns"] = obj["start_ns"] - 2_000_000_000
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    aiperf = tmp_path / "aiperf.jsonl"
    first, *rest = (DATA / "aiperf_profile_export.jsonl").read_text().splitlines(keepends=True)
    row = json.loads(first)
    row["metadata"]["request_end_ns"] = row["metadata"]["request_start_ns"] - 1
    aiperf.write_text(json.dumps(row) + "\n" + "".join(rest))  # the rest as it is, its bad row too
    proc = gputrace_process("import", "--run", str(tmp_path / "run"), "--requests", str(path),
                            "--aiperf", str(aiperf), "--aiperf-phase", "C=32")
    assert proc.returncode == 0, proc.stderr
    aiperf_line, requests_line = proc.stdout.strip().splitlines()
    assert f"{len(requests) - 2} requests, " in requests_line
    assert requests_line.endswith("imported; 2 requests ending before they start dropped")
    assert ("5 requests, 2 markers imported; 1 requests ending before they start dropped; 1 bad rows"
            in aiperf_line)
    with Store.open(tmp_path / "run", read_only=True) as store:
        stored = store.records(RequestRecord)
    assert len(stored) == len(requests) - 2 + 5
    assert not backwards & {r.request_id for r in stored}
    assert all(r.end_ns is None or r.end_ns >= r.start_ns for r in stored)


def test_impossible_stamps_are_counted_in_the_summary(tmp_path: Path) -> None:
    """SGLang lines stamped Feb 30, hour 25 and year 9999 were stored with no time and nothing
    said: the summary counts them with the first one's line; every line is still stored."""
    lines = ENGINE_LOG.read_text().splitlines(keepends=True)
    batch = [i for i, line in enumerate(lines) if "] Decode batch" in line or "] Prefill batch" in line]
    bad = {batch[5]: "2026-02-30 10:00:00", batch[6]: "2026-01-15 25:00:00", batch[7]: "9999-01-15 10:00:00"}
    for i, stamp in bad.items():
        lines[i] = "[" + stamp + lines[i][20:]
    log = tmp_path / "engine.log"
    log.write_text("".join(lines))
    proc = gputrace_process("import", "--run", str(tmp_path / "run"), "--sglang-log", str(log))
    assert proc.returncode == 0, proc.stderr
    (summary,) = proc.stdout.strip().splitlines()
    assert summary.endswith(f"; 3 events with no valid time, stored untimed (an impossible date or hour, or "
                            f"no date: --date gives one; first: line {batch[5] + 1})")
    with Store.open(tmp_path / "run", read_only=True) as store:
        untimed = store.sql("SELECT line_no FROM scheduler_events WHERE log_ts_ns IS NULL ORDER BY line_no")
    assert untimed == [(i + 1,) for i in sorted(bad)]
