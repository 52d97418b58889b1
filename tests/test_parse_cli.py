"""`gputrace parse`: NDJSON on stdout with the documented keys, stdin and .gz input, summary on stderr."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import shared_data
from helpers import gputrace_process

SGLANG_LINES = shared_data("sglang/real-lines.txt")
VLLM_LINES = SGLANG_LINES.parent.parent / "vllm" / "real-lines.txt"

KEYS = ["kind", "engine", "ts", "dp_rank", "pp_rank", "tp_rank", "ep_rank", "running_req", "queue_req",
        "new_seq", "new_token", "cached_token", "num_token", "token_usage", "gen_throughput_tok_s",
        "input_throughput_tok_s", "cuda_graph"]


def _parse(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return gputrace_process("parse", *args, stdin=stdin, timeout_s=60)


def _objects(stdout: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in stdout.splitlines()]


def test_ndjson_keys_and_values() -> None:
    """Each recognised line is one JSON object with every documented key, in order, null when absent."""
    out = _parse(str(SGLANG_LINES))
    assert out.returncode == 0, out.stderr
    objects = _objects(out.stdout)
    assert len(objects) == 75
    batches = [o for o in objects if o["kind"] != "config"]
    assert all(list(o) == KEYS for o in batches)
    pp2 = [o for o in batches if o["pp_rank"] == 2]
    assert pp2 == [{
        "kind": "decode", "engine": "sglang", "ts": "2026-06-24 15:38:02", "dp_rank": None, "pp_rank": 2,
        "tp_rank": None, "ep_rank": None, "running_req": 1, "queue_req": 0, "new_seq": None,
        "new_token": None, "cached_token": None, "num_token": 998080, "token_usage": 0.59,
        "gen_throughput_tok_s": 200.33, "input_throughput_tok_s": None, "cuda_graph": True}]


def test_config_lines_carry_sglang_names() -> None:
    """A configuration line's object adds its fields by their SGLang names."""
    objects = _objects(_parse(str(SGLANG_LINES)).stdout)
    configs = [o for o in objects if o["kind"] == "config"]
    assert [c["tp_rank"] for c in configs] == [4, 0]
    assert list(configs[0])[: len(KEYS)] == KEYS
    assert {k: configs[0][k] for k in list(configs[0])[len(KEYS):]} == {
        "max_total_num_tokens": 201681, "chunked_prefill_size": 8192, "max_prefill_tokens": 16384,
        "max_running_requests": 2049, "context_len": 163840}


def test_summary_on_stderr() -> None:
    """stderr says how many lines were read, recognised per kind and unrecognised."""
    out = _parse(str(SGLANG_LINES))
    assert out.stderr.strip() == (
        "total: 103 lines read; recognised prefill 43, decode 30, config 2, stats 0; unrecognised 28")


def test_stdin_and_gzip(tmp_path: Path) -> None:
    """'-' reads stdin and .gz files are decompressed; several files get one summary line each."""
    gz = tmp_path / "sglang.log.gz"
    gz.write_bytes(gzip.compress(SGLANG_LINES.read_bytes()))
    out = _parse(str(gz), "-", stdin=VLLM_LINES.read_text())
    assert out.returncode == 0, out.stderr
    objects = _objects(out.stdout)
    assert [o["engine"] for o in objects].count("vllm") == 12
    assert [o["engine"] for o in objects].count("sglang") == 75
    assert objects[-1]["kind"] == "stats" and objects[-1]["gen_throughput_tok_s"] == 117.6
    err = out.stderr.splitlines()
    assert err == [
        f"{gz}: 103 lines read; recognised prefill 43, decode 30, config 2, stats 0; unrecognised 28",
        "-: 18 lines read; recognised prefill 0, decode 0, config 0, stats 12; unrecognised 6",
        "total: 121 lines read; recognised prefill 43, decode 30, config 2, stats 12; unrecognised 34",
    ]


def test_engine_choice_limits_the_grammar() -> None:
    """--engine vllm reads no SGLang line (and says that it recognised nothing)."""
    out = _parse("--engine", "vllm", str(SGLANG_LINES))
    assert out.returncode == 1 and out.stdout == ""
    assert "no vllm scheduler, stats or configuration line recognised" in out.stderr


def test_missing_file_is_a_usage_error(tmp_path: Path) -> None:
    """A missing file is one line on stderr and exit status 2, before any output."""
    out = _parse(str(SGLANG_LINES), str(tmp_path / "nope.log"))
    assert out.returncode == 2
    assert out.stdout == ""
    assert out.stderr.strip() == f"gputrace: error: {tmp_path / 'nope.log'}: no such file"


@pytest.mark.parametrize(("path", "what"), [("/dev/zero", "a character device"), ("DIR", "a directory")])
def test_a_device_or_directory_is_named_for_what_it_is(tmp_path: Path, path: str, what: str) -> None:
    """`parse /dev/zero` said "no such file" of a file that exists: a device or a directory is one
    line saying what it is, exit 2, before any output."""
    path = str(tmp_path) if path == "DIR" else path
    out = _parse(path)
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr.splitlines() == [f"gputrace: error: {path}: is {what}, not a file (give a log "
                                       "or capture file, or a pipe)"]


def test_a_pipe_is_parsed_as_the_file_is() -> None:
    """`parse <(cat log)` was refused as "no such file": a pipe gives the objects the file gives."""
    out = subprocess.run(["bash", "-c", '"$0" -m gputrace parse <(cat "$1")', sys.executable,
                          str(SGLANG_LINES)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == _parse(str(SGLANG_LINES)).stdout != ""


def test_binary_garbage_is_counted_not_fatal(tmp_path: Path) -> None:
    """Invalid UTF-8 and NUL bytes are unrecognised lines, not a crash."""
    bad = tmp_path / "bad.log"
    bad.write_bytes(b"\xff\xfe\x00garbage\n[2026-01-02 03:04:05 PP0] Decode batch, #running-req: 2\n\x80\n")
    out = _parse(str(bad))
    assert out.returncode == 0
    assert [o["running_req"] for o in _objects(out.stdout)] == [2]
    assert "3 lines read" in out.stderr


# The recorded real-engine runs (tests/data/engines/, SGLang 0.5.23 and vLLM 0.32.0 at PP=2).
REAL_ENGINE_LOGS = sorted((Path(__file__).parent / "data" / "engines").glob("*/*/engine.log"))


def test_fast_path_gives_the_per_line_objects(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """SGLang's current batch lines go through the vectorised fast path: the NDJSON and the counts
    are exactly what the per-line grammar gives, in file order, across chunks and every variant."""
    import io

    from gputrace.commands.parse import _parse_all

    variants = [
        "[2026-06-24 15:38:02 PP2] Decode batch, #running-req: 1, #token: 998080, token usage: 0.59, "
        "cuda graph: True, gen throughput (token/s): 200.33, #queue-req: 0, ",
        "[2026-06-24 15:38:02.125 DP1 PP0 TP3] Decode batch, #running-req: 12, #token: 4, token usage: "
        "0.00, cpu graph: False, gen throughput (token/s): 0.10, #queue-req: 7",
        "[2026-06-24 15:38:03 TP0 EP1] Decode batch [41], #running-req: 3, #token: 77, token usage: "
        "1.00, cuda graph: True, gen throughput (token/s): 12.00, #queue-req: 0",
        "[2026-06-24 15:38:03] Prefill batch, #new-seq: 2, #new-token: 8192, #cached-token: 0, token "
        "usage: 0.31, #running-req: 5, #queue-req: 11, #pending-token: 900, cuda graph: False, "
        "input throughput (token/s): 19000.55",
        "[2026-06-24 15:38:04 PP7] Prefill batch, #new-seq: 1, #new-token: 16, #cached-token: 3, "
        "token usage: 0.02, #running-req: 0, #queue-req: 0",
        "[2026-06-24 15:38:04 PP1] Decode batch, #running-req: 1, #token: 5, token usage: 0.01, "
        "cuda graph: True, gen throughput (token/s): 9.5, #queue-req: 0 trailing junk",
        "[2025-05-31 18:31:21 DP6 TP6] Decode batch. #running-req: 8, #token: 36267, token usage: 0.12, "
        "accept len: 2.86, cuda graph: True, gen throughput (token/s): 168.28, #queue-req: 0",
        "[2025-09-03 18:33:19 TP0] Decode batch. #running-req: 1, #token: 137, token usage: 0.00, "
        "cuda graph: True, gen throughput (token/s): 1.06, #queue-req: 0, ",
        "[2025-09-03 18:33:18 TP0] Prefill batch. #new-seq: 1, #new-token: 103, #cached-token: 1, "
        "token usage: 0.00, #running-req: 0, #queue-req: 0, ",
        "[2024-11-29 10:28:26 TP0] Decode batch. #running-req: 3, #token: 6144, token usage: 0.01, "
        "gen throughput (token/s): 19.65, #queue-req: 70",
        "[2026-08-23 09:05:37 TP0 EP0] Decode batch, #running-req: 1, #full token: 165376, full token "
        "usage: 0.02, #swa token: 768, swa token usage: 0.00, accept len: 5.30, accept rate: 0.86, cuda "
        "graph: True, gen throughput (token/s): 167.04, #queue-req: 0",
        "[2026-08-23 09:06:04 TP0 EP0] Prefill batch, #new-seq: 1, #new-token: 8192, #cached-token: 0, "
        "full token usage: 0.00, swa token usage: 0.01, #running-req: 0, #queue-req: 0, #pending-token: "
        "157704, cuda graph: False, input throughput (token/s): 824.28",
        "[15:38:05 TP0] Decode batch. #running-req: 2, #token: 80, token usage: 0.00, gen throughput "
        "(token/s): 40.00, #queue-req: 0",
        '[2026-06-24 15:38:05] INFO:     10.0.0.7:40000 - "POST /v1/chat/completions HTTP/1.1" 200 OK',
        "[2026-06-24 15:38:05 TP0] max_total_num_tokens=201681, chunked_prefill_size=8192, "
        "max_prefill_tokens=16384, max_running_requests=2049, context_len=163840",
        "\u00e9\u00e8 not a scheduler line",
        "INFO 06-24 15:38:06 [loggers.py:87] Engine 000: Avg prompt throughput: 1254.4 tokens/s, Avg "
        "generation throughput: 29.2 tokens/s, Running: 10 reqs, Waiting: 4 reqs, GPU KV cache usage: "
        "57.9%, Prefix cache hit rate: 40.5%",
        # magnitudes where Arrow's text of a double differs from json.dumps (an exponent, no ".0")
        "[2026-06-24 15:38:06 PP3] Decode batch, #running-req: 2, #token: 10, token usage: 0.00001, "
        "cuda graph: True, gen throughput (token/s): 99999999999999.5, #queue-req: 0",
        "[2026-06-24 15:38:06 PP4] Prefill batch, #new-seq: 1, #new-token: 16, #cached-token: 3, "
        "token usage: 0.0001, #running-req: 0, #queue-req: 0, #pending-token: 0, cuda graph: True, "
        "input throughput (token/s): 1234567890123.00",
    ]
    log = tmp_path / "mixed.log"
    # enough lines to cross the 1 MiB chunks several times, in a shuffled but fixed order
    lines = [variants[(i * 11) % len(variants)] for i in range(30_000)]
    assert len(variants) % 11
    log.write_text("\n".join(lines) + "\n")
    # the same lines as a container runtime logs them (CRI files, `docker logs -t`), a few without
    runtime = ["2026-06-24T15:38:02.123456789Z stdout F ", "2026-06-24T15:38:02Z ",
               " 2026-06-24T15:38:02.5+02:00 stderr P ", "2026-06-24T15:38:02Z stdout F", ""]
    container_log = tmp_path / "container.log"
    container_log.write_text("\n".join(runtime[i % 13 % len(runtime)] + line
                                       for i, line in enumerate(lines)) + "\n")
    for engine in ("auto", "sglang"):  # auto: vLLM lines among SGLang's are still read
        for path in (log, container_log, SGLANG_LINES, VLLM_LINES, *REAL_ENGINE_LOGS):
            fast, slow = io.StringIO(), io.StringIO()
            _parse_all((str(path),), engine, fast, fast=True)
            _parse_all((str(path),), engine, slow, fast=False)
            assert fast.getvalue() == slow.getvalue(), (engine, path)
    capsys.readouterr()
    _parse_all((str(log),), "auto", io.StringIO(), fast=False)
    summary = capsys.readouterr().err.strip()
    assert f"stats {sum(line.startswith('INFO ') for line in lines)}" in summary  # the vLLM lines
    out = _parse(str(log))
    assert out.returncode == 0 and out.stderr.strip() == summary


def test_the_command_writes_what_the_per_line_grammar_gives(tmp_path: Path) -> None:
    """`gputrace parse` as users run it writes the per-line grammar's NDJSON byte for byte, in file
    order, where chunks of fast-path lines alone (written to stdout's binary stream) follow and
    precede chunks with other lines (written as text)."""
    import io

    from gputrace.commands.parse import _parse_all

    decode = ("[2026-06-24 15:38:{s:02d} PP{p}] Decode batch, #running-req: {r}, #token: {t}, token usage: "
              "0.{u:02d}, cuda graph: True, gen throughput (token/s): {g}.25, #queue-req: 0")
    other = [" INFO:     10.0.0.7:40000 - \"POST /generate HTTP/1.1\" 200 OK",  # no scheduler line
             "[2026-06-24 15:38:05 TP0] max_total_num_tokens=201681, chunked_prefill_size=8192, "
             "max_prefill_tokens=16384, max_running_requests=2049, context_len=163840",
             "[2026-06-24 15:38:05] Decode batch, #running-req: 1 and more"]
    lines = []
    for i in range(40_000):  # about 1 MiB each 6,600 lines: most chunks hold fast lines only
        lines.append(other[i // 10_000 % 3] if i % 10_000 == 17 else
                     decode.format(s=i // 700 % 60, p=i % 8, r=i % 64, t=i * 7, u=i % 100, g=i % 999))
    log = tmp_path / "pp8.log"
    log.write_text("\n".join(lines) + "\n")
    per_line = io.StringIO()
    _parse_all((str(log),), "sglang", per_line, fast=False)
    done = _parse("--engine", "sglang", str(log))
    assert done.returncode == 0, done.stderr
    assert done.stdout == per_line.getvalue()
    assert len(done.stdout.splitlines()) == 40_000 - 2  # all but the two access lines


def test_json_text_of_doubles_is_json_dumps() -> None:
    """The fast path's JSON text of a float column is json.dumps's for every magnitude: Arrow's
    shortest digits where both write positional ones, json.dumps's text elsewhere."""
    import random

    import pyarrow as pa

    from gputrace.engines.ndjson import _float_text

    rnd = random.Random(1)
    values: list[float | None] = [0.5, 300.0, 1e-05, 1e16, 0.0001, -0.0, 123456789012345.0, 0.1 + 0.2,
                                  1e15, None, 9999999999999.5, float("inf"), float("nan"), 5e-324]
    values += [rnd.uniform(-1, 1) * 10 ** rnd.randint(-8, 20) for _ in range(20_000)]
    values += [round(rnd.uniform(0, 1e6), rnd.randint(0, 4)) for _ in range(20_000)]
    assert _float_text(pa.array(values)).to_pylist() == [json.dumps(v) for v in values]
