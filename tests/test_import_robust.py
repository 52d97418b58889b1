"""`gputrace import` and `gputrace parse` on real files that are repeated, cut or hold bad values
([robust] #25 items 2, 3, 4, 9 and 13): nothing doubled, nothing lost that can be read, a bad
value costs its row or its field (counted), never the file."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import zlib
from pathlib import Path

import pytest
from helpers import gputrace_process

from gputrace.commands.parse import _parse_all
from gputrace.store import Store

DATA = Path(__file__).parent / "import_data"
ENGINES = Path(__file__).parent / "data" / "engines"
SGLANG = ENGINES / "sglang-0.5.23-pp2" / "default"
VLLM = ENGINES / "vllm-0.32.0-pp2" / "default"
TABLES = ("scheduler_events", "engine_configs", "requests", "markers", "gpu_samples")


def _counts(run: Path) -> dict[str, int]:
    with Store.open(run, read_only=True) as store:
        return {table: store.count(table) for table in TABLES}


# -- item 2: the same content imported twice adds nothing ------------------------------------------

KINDS = [
    ("--sglang-log", SGLANG / "engine.log", ()),
    ("--vllm-log", VLLM / "engine.log", ("--date", "2026-12-01")),
    ("--aiperf", DATA / "aiperf_profile_export.jsonl", ("--aiperf-phase", "C=32")),
    ("--guidellm", DATA / "guidellm_0.4_benchmarks.json", ()),
    ("--requests", SGLANG / "requests.jsonl", ()),
    ("--nvidia-smi-csv", DATA / "nvidia_smi_query.csv", ()),
    ("--nvidia-smi-dmon", DATA / "nvidia_smi_dmon_dt.txt", ()),
]


@pytest.mark.parametrize(("option", "source", "extra"), KINDS, ids=[k[0] for k in KINDS])
def test_the_same_file_imported_again_adds_nothing(tmp_path: Path, option: str, source: Path,
                                                   extra: tuple[str, ...]) -> None:
    """Imported again under another name, in another directory, by a relative path: one line
    'already imported: ... (imported <when> as <first path>)', exit 0, every table as it was."""
    run = tmp_path / "run"
    first = gputrace_process("import", "--run", str(run), option, str(source), *extra)
    assert first.returncode == 0, first.stderr
    once = _counts(run)
    assert sum(once.values()) > 0
    other = tmp_path / "elsewhere"
    other.mkdir()
    shutil.copy(source, other / ("renamed-" + source.name))
    again = gputrace_process("import", "--run", str(run), option, "renamed-" + source.name, *extra, cwd=other)
    assert again.returncode == 0, again.stderr
    (line,) = again.stdout.strip().splitlines()
    assert line.startswith(f"already imported: renamed-{source.name} (imported ")
    assert line.endswith(f" as {source.resolve()})")
    assert _counts(run) == once


def test_the_same_file_twice_in_one_command_goes_in_once(tmp_path: Path) -> None:
    """`--requests A --requests copy-of-A`: the second is said to be there already."""
    copy = tmp_path / "copy.jsonl"
    shutil.copy(SGLANG / "requests.jsonl", copy)
    run = tmp_path / "run"
    proc = gputrace_process("import", "--run", str(run), "--requests", str(SGLANG / "requests.jsonl"),
                     "--requests", str(copy))
    assert proc.returncode == 0, proc.stderr
    first, second = proc.stdout.strip().splitlines()
    assert "128 requests, 4 markers imported" in first and second.startswith("already imported: ")
    assert (_counts(run)["requests"], _counts(run)["markers"]) == (128, 4)


def test_changed_content_under_the_same_path_is_imported(tmp_path: Path) -> None:
    """The ledger keys content, not names: a file that grew is new content and goes in."""
    log = tmp_path / "engine.log"
    lines = SGLANG.joinpath("engine.log").read_text().splitlines(keepends=True)
    log.write_text("".join(lines[:2000]))
    run = tmp_path / "run"
    assert gputrace_process("import", "--run", str(run), "--sglang-log", str(log)).returncode == 0
    before = _counts(run)["scheduler_events"]
    log.write_text("".join(lines))
    proc = gputrace_process("import", "--run", str(run), "--sglang-log", str(log))
    assert proc.returncode == 0 and "already imported" not in proc.stdout
    assert _counts(run)["scheduler_events"] > before


def test_files_that_share_their_ends_are_told_apart_by_content(tmp_path: Path) -> None:
    """The ledger's cheap probe (size, first and last MiB) only finds candidates: two JSONL files
    of 3 MiB that differ in one byte in the middle (one request's id) are both read, and the
    request only the second holds goes in."""
    lines = SGLANG.joinpath("requests.jsonl").read_text().splitlines()
    body = [line for line in lines if '"type":"request"' in line]
    repeat = [line.replace('"request_id":"', f'"request_id":"{k}-', 1)  # each request once
              for k, line in enumerate(body * (3 * (1 << 20) // len("\n".join(body)) + 1))]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("\n".join(repeat) + "\n")
    middle = len(repeat) // 2
    repeat[middle] = repeat[middle].replace('"request_id":"', '"request_id":"x', 1)
    b.write_text("\n".join(repeat) + "\n")
    assert a.stat().st_size + 1 == b.stat().st_size > 3 << 20
    run = tmp_path / "run"
    proc = gputrace_process("import", "--run", str(run), "--requests", str(a), "--requests", str(b))
    assert proc.returncode == 0 and "already imported" not in proc.stdout
    assert _counts(run)["requests"] == len(repeat) + 1


@pytest.mark.parametrize("form", ["plain", "gz", "cut gz", "corrupt gz"])
def test_the_ledger_holds_the_sha256_of_the_files_bytes(tmp_path: Path, form: str) -> None:
    """An engine log is hashed as it is read (one pass): the recorded sha256 is the file's own,
    whole-file one, also when the reader stopped at damage, so the same damaged file given again
    is known."""
    plain = SGLANG.joinpath("engine.log").read_bytes()
    packer = zlib.compressobj(6, zlib.DEFLATED, 31)
    data = plain if form == "plain" else packer.compress(plain) + packer.flush()
    if form == "cut gz":
        data = data[: len(data) * 2 // 3]
    if form == "corrupt gz":
        data = data[: len(data) // 3] + bytes(64) + data[len(data) // 3 + 64:]
    log = tmp_path / "engine.log"
    log.write_bytes(data)
    run = tmp_path / "run"
    assert gputrace_process("import", "--run", str(run), "--sglang-log", str(log)).returncode == 0
    with Store.open(run, read_only=True) as store:
        assert store.sql("SELECT sha256, size_bytes FROM imported_files") == [
            (hashlib.sha256(data).hexdigest(), len(data))]
    again = gputrace_process("import", "--run", str(run), "--sglang-log", str(log))
    assert again.returncode == 0 and again.stdout.startswith("already imported: ")


def _phase_throughputs(run: Path, out: Path) -> dict[str, float]:
    proc = gputrace_process("report", str(run), "--format", "json", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    findings = json.loads((out / "findings.json").read_text())
    return {p["label"]: p["throughput_tok_s"] for p in findings["phases"]}


@pytest.mark.slow
def test_a_second_import_does_not_double_the_reports_throughput(tmp_path: Path) -> None:
    """The real SGLang run imported once, and once more from copies: the report's per-phase
    throughput is the same (it doubled, 38 -> 76 tok/s)."""
    run = tmp_path / "run"
    argv = ("--sglang-log", str(SGLANG / "engine.log"), "--requests", str(SGLANG / "requests.jsonl"))
    assert gputrace_process("import", "--run", str(run), *argv).returncode == 0
    once = _phase_throughputs(run, tmp_path / "once")
    for name in ("engine.log", "requests.jsonl"):
        shutil.copy(SGLANG / name, tmp_path / f"copy-{name}")
    again = gputrace_process("import", "--run", str(run), "--sglang-log", str(tmp_path / "copy-engine.log"),
                      "--requests", str(tmp_path / "copy-requests.jsonl"))
    assert again.returncode == 0 and again.stdout.count("already imported: ") == 2
    twice = _phase_throughputs(run, tmp_path / "twice")
    assert once and twice == once
    assert all(v is None or v > 0 for v in once.values())


# -- item 3: a cut .gz log ---------------------------------------------------------------------------

def _cut_gzip(tmp_path: Path, fraction: float) -> tuple[Path, Path]:
    """The real log gzipped and cut at ``fraction`` of its bytes, and what of it decompresses."""
    plain = SGLANG.joinpath("engine.log").read_bytes()
    packer = zlib.compressobj(6, zlib.DEFLATED, 31)
    whole = packer.compress(plain) + packer.flush()
    cut = whole[: int(len(whole) * fraction)]
    gz = tmp_path / "engine.log.gz"
    gz.write_bytes(cut)
    readable = tmp_path / "readable.log"
    readable.write_bytes(zlib.decompressobj(31).decompress(cut))
    return gz, readable


def test_import_of_a_cut_gz_keeps_every_line_that_decompresses(tmp_path: Path) -> None:
    """A .gz cut short imports the lines before the cut (exactly what a plain copy of them gives),
    says the file was cut and where, and exits 0 (it said 'interrupted', exit 130, and kept nothing)."""
    gz, readable = _cut_gzip(tmp_path, 0.88)
    proc = gputrace_process("import", "--run", str(tmp_path / "run"), "--sglang-log", str(gz))
    assert proc.returncode == 0, proc.stderr
    assert "FILE CUT: the gzip data ends before its end marker" in proc.stdout
    assert f"({gz.stat().st_size} bytes of file, {readable.stat().st_size} bytes decompressed)" in proc.stdout
    reference = gputrace_process("import", "--run", str(tmp_path / "ref"), "--sglang-log", str(readable))
    assert reference.returncode == 0
    got, want = _counts(tmp_path / "run"), _counts(tmp_path / "ref")
    assert got["scheduler_events"] == want["scheduler_events"] > 2500
    assert got["engine_configs"] == want["engine_configs"]
    n_lines = readable.read_bytes().count(b"\n") + 1  # the last, cut line counts too
    assert f"its {n_lines} lines before that were read" in proc.stdout


def test_parse_of_a_cut_gz_prints_every_line_that_decompresses(tmp_path: Path) -> None:
    """`gputrace parse` on the cut file prints what the readable part gives, a FILE CUT warning
    on stderr, exit 0."""
    gz, readable = _cut_gzip(tmp_path, 0.5)
    proc = gputrace_process("parse", str(gz))
    assert proc.returncode == 0, proc.stderr
    assert "FILE CUT" in proc.stderr and "interrupted" not in proc.stderr
    reference = gputrace_process("parse", str(readable))
    assert proc.stdout == reference.stdout and proc.stdout.count("\n") > 1000


def test_a_corrupt_gz_keeps_what_comes_before_the_damage(tmp_path: Path) -> None:
    """Bytes overwritten in the middle: the lines before the damage go in, the error is said."""
    gz, _ = _cut_gzip(tmp_path, 1.0)
    data = bytearray(gz.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(64)
    gz.write_bytes(bytes(data))
    proc = gputrace_process("import", "--run", str(tmp_path / "run"), "--sglang-log", str(gz))
    assert proc.returncode == 0, proc.stderr
    assert "FILE CUT" in proc.stdout
    assert 0 < _counts(tmp_path / "run")["scheduler_events"] < 3502


# -- item 4: one bad value costs one row -----------------------------------------------------------

def test_aiperf_nan_infinity_huge_and_deep_values_cost_their_rows(tmp_path: Path) -> None:
    """NaN (as json.dumps writes it), Infinity, 1e400 and 100,000 nested [ each skip their line,
    counted with the reason; the rest is imported (the whole file was lost)."""
    good = [line for line in DATA.joinpath("aiperf_profile_export.jsonl").read_text().splitlines()
            if line.startswith("{") and "\x01" not in line][:6]
    rows = [json.loads(line) for line in good]
    assert len(rows) == 6
    rows[0]["metadata"]["request_start_ns"] = math.nan
    rows[1]["metrics"]["time_to_first_token"]["value"] = math.inf
    lines = [json.dumps(r) for r in rows]
    lines[2] = lines[2].replace(str(rows[2]["metadata"]["request_end_ns"]), "1e400")
    lines.append("[" * 100_000 + "]" * 100_000)
    path = tmp_path / "profile_export.jsonl"
    path.write_text("\n".join(lines) + "\n")
    proc = gputrace_process("import", "--run", str(tmp_path / "run"), "--aiperf", str(path))
    assert proc.returncode == 0, proc.stderr
    assert "3 requests imported; 4 bad rows skipped (first: line 1: nan where a finite number belongs)" \
        in proc.stdout
    assert _counts(tmp_path / "run")["requests"] == 3


def test_guidellm_nan_and_deep_nesting_cost_one_request_each(tmp_path: Path) -> None:
    """guidellm's one JSON document: a NaN start skips its request, a value nested 100,000 deep is
    read as null (counted); the other requests and the phases go in."""
    report = json.loads(DATA.joinpath("guidellm_0.4_benchmarks.json").read_text())
    successful = report["benchmarks"][0]["requests"]["successful"]
    successful[0]["info"]["timings"]["request_start"] = math.nan
    successful[1]["deep"] = "DEEP"
    path = tmp_path / "benchmarks.json"
    path.write_text(json.dumps(report).replace('"DEEP"', "[" * 100_000 + "]" * 100_000))
    proc = gputrace_process("import", "--run", str(tmp_path / "run"), "--guidellm", str(path))
    assert proc.returncode == 0, proc.stderr
    assert "13 requests, 3 markers imported; 2 bad rows skipped" in proc.stdout
    assert "nested deeper than 200 levels" in proc.stdout + proc.stderr
    assert _counts(tmp_path / "run")["requests"] == 13


def test_gputrace_jsonl_bad_values_cost_their_lines(tmp_path: Path) -> None:
    """In gputrace's own JSONL a nested line, a 1e400 start and a NaN end are three bad rows; the
    other 125 requests and 4 markers go in."""
    lines = SGLANG.joinpath("requests.jsonl").read_text().splitlines()
    requests = [i for i, line in enumerate(lines) if '"type":"request"' in line]
    lines[requests[0]] = "[" * 100_000 + "]" * 100_000
    row = json.loads(lines[requests[1]])
    lines[requests[1]] = json.dumps(row).replace(str(row["start_ns"]), "1e400")
    row = json.loads(lines[requests[2]])
    row["end_ns"] = math.nan
    lines[requests[2]] = json.dumps(row)
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n")
    proc = gputrace_process("import", "--run", str(tmp_path / "run"), "--requests", str(path))
    assert proc.returncode == 0, proc.stderr
    assert "125 requests, 4 markers imported; 3 bad rows skipped" in proc.stdout
    counts = _counts(tmp_path / "run")
    assert (counts["requests"], counts["markers"]) == (125, 4)


# -- item 13: one value rule, fast path and per-line grammar alike --------------------------------

EDGES = (
    "[2026-12-01 09:14:00 PP0] Decode batch, #running-req: -5, #token: 9223372036854775807, "
    "token usage: 1e309, cuda graph: True, gen throughput (token/s): 12.50, #queue-req: 0, \n"
    "[2026-12-01 09:14:01 PP0] Decode batch, #running-req: 3, #token: 9223372036854775808, "
    "token usage: inf, cuda graph: True, gen throughput (token/s): -1.00, #queue-req: 2, \n"
    "[2026-12-01 09:14:02 PP0] Decode batch, #running-req: 3, #token: 100, token usage: 0.10, "
    "cuda graph: True, gen throughput (token/s): 1.00, #queue-req: 0, \n"
)


def test_parse_applies_one_value_rule(tmp_path: Path) -> None:
    """#running-req: -5, token usage 1e309 or inf, #token past int64 and a negative throughput are
    bad values: null in the output and counted; #token 9223372036854775807 is kept."""
    log = tmp_path / "edges.log"
    log.write_text(EDGES)
    proc = gputrace_process("parse", str(log))
    assert proc.returncode == 0, proc.stderr
    first, second, third = (json.loads(line) for line in proc.stdout.splitlines())
    assert (first["running_req"], first["num_token"], first["token_usage"]) == (None, 2**63 - 1, None)
    assert (second["running_req"], second["num_token"], second["token_usage"]) == (3, None, None)
    assert second["gen_throughput_tok_s"] is None and second["queue_req"] == 2
    assert (third["running_req"], third["num_token"], third["token_usage"]) == (3, 100, 0.1)
    assert "5 bad values left out (first: " in proc.stderr and "running_req='-5'" in proc.stderr


def test_the_fast_path_and_the_per_line_grammar_agree_on_bad_values(tmp_path: Path) -> None:
    """The real log with edge values spliced in: the vectorised path and the per-line grammar
    give the same objects."""
    lines = SGLANG.joinpath("engine.log").read_text().splitlines(keepends=True)
    log = tmp_path / "mixed.log"
    log.write_text("".join(lines[:1500]) + EDGES + "".join(lines[1500:]))
    fast, slow = tmp_path / "fast.ndjson", tmp_path / "slow.ndjson"
    with fast.open("w") as out:
        _parse_all((str(log),), "sglang", out, fast=True)
    with slow.open("w") as out:
        _parse_all((str(log),), "sglang", out, fast=False)
    assert fast.read_text() == slow.read_text()
    assert '"running_req": null, "queue_req": 0' in fast.read_text()


def test_import_stores_valid_values_and_counts_bad_ones(tmp_path: Path) -> None:
    """Through import: the int64 maximum is stored, the bad values are NULL and counted in the
    summary line."""
    log = tmp_path / "edges.log"
    log.write_text(EDGES)
    run = tmp_path / "run"
    proc = gputrace_process("import", "--run", str(run), "--sglang-log", str(log))
    assert proc.returncode == 0, proc.stderr
    assert "3 events" in proc.stdout and "5 bad values not stored (first: line 1: running_req='-5')" \
        in proc.stdout
    with Store.open(run, read_only=True) as store:
        rows = store.sql("SELECT running_req, num_token, token_usage FROM scheduler_events ORDER BY line_no")
    assert rows == [(None, 2**63 - 1, None), (3, None, None), (3, 100, 0.1)]


# -- item 9: sizes from a log or meta.json --------------------------------------------------------

def _run_with_logged_pp_size(tmp_path: Path, pp_size: str) -> tuple[Path, str]:
    log = tmp_path / "engine.log"
    text = SGLANG.joinpath("engine.log").read_text()
    assert "'pp_size': 2," in text
    log.write_text(text.replace("'pp_size': 2,", f"'pp_size': {pp_size},"))
    run = tmp_path / "run"
    proc = gputrace_process("import", "--run", str(run), "--sglang-log", str(log),
                     "--requests", str(SGLANG / "requests.jsonl"))
    assert proc.returncode == 0, proc.stderr
    return run, proc.stdout


@pytest.mark.parametrize("pp_size", ["-3", "0", "1000000000", "True"])
def test_a_logged_pp_size_outside_1_to_1024_is_a_bad_value(tmp_path: Path, pp_size: str) -> None:
    """The real run with its logged pp_size replaced: counted as a bad value and not stored."""
    run, summary = _run_with_logged_pp_size(tmp_path, pp_size)
    assert f"bad values not stored (first: line 14: pp_size='{pp_size}')" in summary
    with Store.open(run, read_only=True) as store:
        assert store.sql("SELECT count(*) FROM engine_configs WHERE pp_size IS NOT NULL") == [(0,)]


@pytest.mark.slow
@pytest.mark.parametrize("pp_size", ["-3", "1000000000"])
def test_a_report_on_a_log_with_an_impossible_pp_size_runs(tmp_path: Path, pp_size: str) -> None:
    """The report takes the stages from the log's ranks instead (it failed with 'negative
    dimensions', or tried to align 10^9 stages)."""
    run, _ = _run_with_logged_pp_size(tmp_path, pp_size)
    report = gputrace_process("report", str(run), "--format", "json", "--out", str(tmp_path / "rep"))
    assert report.returncode == 0, report.stderr
    assert json.loads((tmp_path / "rep" / "findings.json").read_text())["summary"]["pp_size"] == 2


@pytest.mark.parametrize(("topology", "key"), [
    ({"pp_size": -3, "placements": []}, "topology.pp_size: -3 is not a parallel size"),
    ({"pp_size": 1_000_000_000}, "topology.pp_size: 1000000000 is not a parallel size"),
    ({"pp_size": 2, "placements": [{"host": "h", "gpu_index": 0, "pp_rank": 5}]},
     "topology.placements[0].pp_rank: 5 is outside 0 to 1"),
])
def test_a_meta_json_size_outside_bounds_is_one_error_line(tmp_path: Path, topology: dict[str, object],
                                                          key: str) -> None:
    """meta.json edited to hold an impossible topology: `report` says which field, exit 1."""
    run = tmp_path / "run"
    Store.create(run).close()
    meta = json.loads((run / "meta.json").read_text())
    meta["topology"] = topology
    (run / "meta.json").write_text(json.dumps(meta))
    proc = gputrace_process("report", str(run), "--format", "json", "--out", str(tmp_path / "rep"))
    assert proc.returncode == 1
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("gputrace: error: ") and "meta.json " + key in line
