"""SGLang's log grammar: real pasted lines, every historical form, prefixes, config lines, robustness."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from conftest import shared_data
from hypothesis import given, settings
from hypothesis import strategies as st

from gputrace.engines import LogParser, parse_line, sglang
from gputrace.engines.common import LogClock
from gputrace.errors import UsageError
from gputrace.model import EngineConfig, SchedulerEvent

REAL_LINES = shared_data("sglang/real-lines.txt")

RANKS = ("dp_rank", "pp_rank", "tp_rank", "ep_rank")

# File line number -> (kind, timestamp text, (dp, pp, tp, ep), metric fields) or None for a line
# that is not a scheduler/config line. Config lines carry their fields by SGLang name instead.
# Every value was checked by hand against its pasted line; every non-comment line is listed. Lines
# 82-84 are mangled in the original paste (middle columns cut, right edge truncated): their intact
# fields are read, the cut ones (e.g. ``#cached-tounning-req``, ``token usaccept rate``) are not.
EXPECTED: dict[int, tuple[str, str | None, tuple[int | None, ...], dict[str, object]] | None] = {
    4: ("prefill", None, (None, None, None, None),
        {"running_req": 0, "queue_req": 0, "new_seq": 1, "new_token": 18, "cached_token": 2510}),
    6: ("prefill", None, (None, None, None, None),
        {"running_req": 9, "queue_req": 57, "new_seq": 1, "new_token": 2172, "cached_token": 330}),
    8: ("prefill", None, (None, None, 0, None),
        {"running_req": 389, "queue_req": 40, "new_seq": 2, "new_token": 1074, "cached_token": 0}),
    9: ("prefill", None, (None, None, 0, None),
        {"running_req": 391, "queue_req": 39, "new_seq": 1, "new_token": 232, "cached_token": 0}),
    10: ("prefill", None, (None, None, 0, None),
        {"running_req": 392, "queue_req": 37, "new_seq": 2, "new_token": 967, "cached_token": 0}),
    11: ("prefill", None, (None, None, 0, None),
        {"running_req": 393, "queue_req": 36, "new_seq": 1, "new_token": 114, "cached_token": 0}),
    12: ("prefill", None, (None, None, 0, None),
        {"running_req": 392, "queue_req": 34, "new_seq": 2, "new_token": 1382, "cached_token": 0}),
    13: ("prefill", None, (None, None, 0, None),
        {"running_req": 394, "queue_req": 33, "new_seq": 1, "new_token": 136, "cached_token": 0}),
    14: ("prefill", None, (None, None, 0, None),
        {"running_req": 395, "queue_req": 32, "new_seq": 1, "new_token": 739, "cached_token": 0}),
    15: ("prefill", None, (None, None, 0, None),
        {"running_req": 391, "queue_req": 31, "new_seq": 1, "new_token": 889, "cached_token": 0}),
    16: ("prefill", None, (None, None, 0, None),
        {"running_req": 389, "queue_req": 29, "new_seq": 2, "new_token": 1046, "cached_token": 0}),
    18: ("prefill", "2024-11-29 10:28:25", (None, None, 0, None),
        {"running_req": 1, "queue_req": 30, "new_seq": 2, "new_token": 2048, "cached_token": 2048,
         "token_usage": 0.0}),
    19: ("prefill", "2024-11-29 10:28:26", (None, None, 0, None),
        {"running_req": 2, "queue_req": 48, "new_seq": 2, "new_token": 2048, "cached_token": 2031,
         "token_usage": 0.0}),
    20: ("prefill", "2024-11-29 10:28:26", (None, None, 0, None),
        {"running_req": 3, "queue_req": 70, "new_seq": 2, "new_token": 2048, "cached_token": 2014,
         "token_usage": 0.01}),
    21: ("prefill", "2024-11-29 10:28:26", (None, None, 0, None),
        {"running_req": 4, "queue_req": 85, "new_seq": 2, "new_token": 2048, "cached_token": 1997,
         "token_usage": 0.01}),
    22: ("prefill", "2024-11-29 10:28:26", (None, None, 0, None),
        {"running_req": 5, "queue_req": 112, "new_seq": 2, "new_token": 2048, "cached_token": 1980,
         "token_usage": 0.01}),
    23: ("prefill", "2024-11-29 10:28:26", (None, None, 0, None),
        {"running_req": 6, "queue_req": 128, "new_seq": 2, "new_token": 2048, "cached_token": 1963,
         "token_usage": 0.01}),
    24: ("prefill", "2024-11-29 10:28:26", (None, None, 0, None),
        {"running_req": 7, "queue_req": 155, "new_seq": 2, "new_token": 2048, "cached_token": 1946,
         "token_usage": 0.01}),
    26: None,
    27: None,
    28: None,
    29: ("config", "2025-03-07 09:31:43", (None, None, 4, None),
        {"max_total_num_tokens": 201681, "chunked_prefill_size": 8192, "max_prefill_tokens": 16384,
         "max_running_requests": 2049, "context_len": 163840}),
    30: ("config", "2025-03-07 09:31:43", (None, None, 0, None),
        {"max_total_num_tokens": 201681, "chunked_prefill_size": 8192, "max_prefill_tokens": 16384,
         "max_running_requests": 2049, "context_len": 163840}),
    32: ("decode", "2025-05-31 18:31:21", (0, None, 0, None),
        {"running_req": 8, "queue_req": 0, "num_token": 37217, "token_usage": 0.13,
         "gen_throughput_tok_s": 171.01, "cuda_graph": True}),
    33: ("decode", "2025-05-31 18:31:21", (6, None, 6, None),
        {"running_req": 8, "queue_req": 0, "num_token": 36267, "token_usage": 0.12,
         "gen_throughput_tok_s": 168.28, "cuda_graph": True}),
    34: ("decode", "2025-05-31 18:31:21", (5, None, 5, None),
        {"running_req": 8, "queue_req": 0, "num_token": 37565, "token_usage": 0.13,
         "gen_throughput_tok_s": 173.06, "cuda_graph": True}),
    35: ("decode", "2025-05-31 18:31:23", (7, None, 7, None),
        {"running_req": 8, "queue_req": 0, "num_token": 37357, "token_usage": 0.13,
         "gen_throughput_tok_s": 155.8, "cuda_graph": True}),
    36: ("decode", "2025-05-31 18:31:25", (2, None, 2, None),
        {"running_req": 8, "queue_req": 0, "num_token": 37787, "token_usage": 0.13,
         "gen_throughput_tok_s": 152.08, "cuda_graph": True}),
    38: ("prefill", "2025-09-03 18:33:18", (None, None, 0, None),
        {"running_req": 0, "queue_req": 0, "new_seq": 1, "new_token": 103, "cached_token": 1,
         "token_usage": 0.0}),
    39: ("decode", "2025-09-03 18:33:19", (None, None, 0, None),
        {"running_req": 1, "queue_req": 0, "num_token": 137, "token_usage": 0.0,
         "gen_throughput_tok_s": 1.06, "cuda_graph": True}),
    40: ("decode", "2025-09-03 18:33:19", (None, None, 0, None),
        {"running_req": 1, "queue_req": 0, "num_token": 177, "token_usage": 0.0,
         "gen_throughput_tok_s": 84.2, "cuda_graph": True}),
    41: None,
    42: ("prefill", "2025-09-03 18:33:31", (None, None, 0, None),
        {"running_req": 0, "queue_req": 0, "new_seq": 1, "new_token": 18, "cached_token": 184,
         "token_usage": 0.0}),
    43: ("decode", "2025-09-03 18:33:32", (None, None, 0, None),
        {"running_req": 1, "queue_req": 0, "num_token": 234, "token_usage": 0.0,
         "gen_throughput_tok_s": 3.17, "cuda_graph": True}),
    44: ("decode", "2025-09-03 18:33:32", (None, None, 0, None),
        {"running_req": 1, "queue_req": 0, "num_token": 274, "token_usage": 0.0,
         "gen_throughput_tok_s": 81.97, "cuda_graph": True}),
    45: None,
    46: ("prefill", "2025-09-03 18:33:41", (None, None, 0, None),
        {"running_req": 0, "queue_req": 0, "new_seq": 1, "new_token": 15, "cached_token": 275,
         "token_usage": 0.0}),
    48: ("decode", "2025-10-29 02:27:35", (15, None, 15, 15),
        {"running_req": 48, "queue_req": 13, "num_token": 571264, "token_usage": 0.76,
         "gen_throughput_tok_s": 740.64, "cuda_graph": True}),
    49: ("decode", "2025-10-29 02:27:35", (9, None, 9, 9),
        {"running_req": 48, "queue_req": 13, "num_token": 573312, "token_usage": 0.76,
         "gen_throughput_tok_s": 744.66, "cuda_graph": True}),
    50: ("decode", "2025-10-29 02:27:35", (14, None, 14, 14),
        {"running_req": 48, "queue_req": 14, "num_token": 571840, "token_usage": 0.76,
         "gen_throughput_tok_s": 741.26, "cuda_graph": True}),
    51: ("decode", "2025-10-29 02:27:40", (13, None, 13, 13),
        {"running_req": 48, "queue_req": 17, "num_token": 578688, "token_usage": 0.77,
         "gen_throughput_tok_s": 719.54, "cuda_graph": True}),
    53: ("prefill", "2025-11-11 04:27:58", (None, None, None, None),
        {"running_req": 0, "queue_req": 0, "new_seq": 3, "new_token": 771, "cached_token": 0,
         "token_usage": 0.0}),
    54: ("prefill", "2025-11-11 04:27:59", (None, None, None, None),
        {"running_req": 3, "queue_req": 0, "new_seq": 13, "new_token": 3341, "cached_token": 0,
         "token_usage": 0.0}),
    55: ("prefill", "2025-11-11 04:28:01", (None, None, None, None),
        {"running_req": 0, "queue_req": 0, "new_seq": 4, "new_token": 895, "cached_token": 4,
         "token_usage": 0.0}),
    56: ("prefill", "2025-11-11 04:28:01", (None, None, None, None),
        {"running_req": 4, "queue_req": 186, "new_seq": 10, "new_token": 4096, "cached_token": 10,
         "token_usage": 0.0}),
    57: ("prefill", "2025-11-11 04:28:01", (None, None, None, None),
        {"running_req": 13, "queue_req": 170, "new_seq": 17, "new_token": 4096, "cached_token": 16,
         "token_usage": 0.03}),
    58: ("prefill", "2025-11-11 04:28:01", (None, None, None, None),
        {"running_req": 29, "queue_req": 153, "new_seq": 18, "new_token": 4096, "cached_token": 19,
         "token_usage": 0.05}),
    59: ("prefill", "2025-11-11 04:28:01", (None, None, None, None),
        {"running_req": 46, "queue_req": 141, "new_seq": 13, "new_token": 4096, "cached_token": 18,
         "token_usage": 0.07}),
    60: ("prefill", "2025-11-11 04:28:02", (None, None, None, None),
        {"running_req": 58, "queue_req": 125, "new_seq": 17, "new_token": 4096, "cached_token": 31,
         "token_usage": 0.09}),
    61: ("prefill", "2025-11-11 04:28:02", (None, None, None, None),
        {"running_req": 74, "queue_req": 120, "new_seq": 6, "new_token": 4096, "cached_token": 8,
         "token_usage": 0.12}),
    63: None,
    64: None,
    65: None,
    66: None,
    68: ("decode", "2026-03-17 17:35:07", (9, None, 9, None),
        {"running_req": 12, "queue_req": 0, "num_token": 768, "token_usage": 0.0,
         "gen_throughput_tok_s": 3.83, "cuda_graph": True}),
    69: ("decode", "2026-03-17 17:35:07", (13, None, 13, None),
        {"running_req": 12, "queue_req": 0, "num_token": 768, "token_usage": 0.0,
         "gen_throughput_tok_s": 3.83, "cuda_graph": True}),
    70: ("decode", "2026-03-17 17:35:07", (15, None, 15, None),
        {"running_req": 12, "queue_req": 0, "num_token": 768, "token_usage": 0.0,
         "gen_throughput_tok_s": 3.82, "cuda_graph": True}),
    71: ("decode", "2026-03-17 17:35:07", (10, None, 10, None),
        {"running_req": 12, "queue_req": 0, "num_token": 768, "token_usage": 0.0,
         "gen_throughput_tok_s": 3.84, "cuda_graph": True}),
    72: ("decode", "2026-03-17 17:35:07", (14, None, 14, None),
        {"running_req": 12, "queue_req": 0, "num_token": 768, "token_usage": 0.0,
         "gen_throughput_tok_s": 3.83, "cuda_graph": True}),
    73: ("decode", "2026-03-17 17:35:07", (11, None, 11, None),
        {"running_req": 12, "queue_req": 0, "num_token": 768, "token_usage": 0.0,
         "gen_throughput_tok_s": 3.83, "cuda_graph": True}),
    74: ("decode", "2026-03-17 17:35:07", (12, None, 12, None),
        {"running_req": 12, "queue_req": 0, "num_token": 768, "token_usage": 0.0,
         "gen_throughput_tok_s": 3.83, "cuda_graph": True}),
    75: ("decode", "2026-03-17 17:35:07", (8, None, 8, None),
        {"running_req": 12, "queue_req": 0, "num_token": 768, "token_usage": 0.0,
         "gen_throughput_tok_s": 3.83, "cuda_graph": True}),
    77: ("decode", "2026-04-05 20:02:51", (None, None, None, None),
        {"running_req": 32, "queue_req": 0, "num_token": 11179, "token_usage": 0.08,
         "gen_throughput_tok_s": 1635.11, "cuda_graph": True}),
    78: ("prefill", "2026-04-05 20:02:51", (None, None, None, None),
        {"running_req": 31, "queue_req": 0, "new_seq": 1, "new_token": 158, "cached_token": 0,
         "token_usage": 0.08, "input_throughput_tok_s": 559.53, "cuda_graph": True}),
    79: ("prefill", "2026-04-05 20:02:52", (None, None, None, None),
        {"running_req": 31, "queue_req": 0, "new_seq": 1, "new_token": 290, "cached_token": 0,
         "token_usage": 0.08, "input_throughput_tok_s": 1670.03, "cuda_graph": True}),
    80: ("prefill", "2026-04-05 20:02:52", (None, None, None, None),
        {"running_req": 31, "queue_req": 0, "new_seq": 1, "new_token": 160, "cached_token": 0,
         "token_usage": 0.08, "input_throughput_tok_s": 4099.38, "cuda_graph": True}),
    82: ("prefill", "2026-05-28 02:59:52", (None, None, 0, None),
        {"queue_req": 92, "new_seq": 1, "new_token": 896, "cuda_graph": False}),
    83: ("prefill", "2026-05-28 02:59:52", (None, None, 0, None),
        {"queue_req": 89, "new_seq": 1, "new_token": 1024, "cuda_graph": False}),
    84: ("decode", "2026-05-28 02:59:59", (None, None, 0, None),
        {"running_req": 45, "num_token": 44672, "gen_throughput_tok_s": 863.65, "cuda_graph": False}),
    86: ("decode", "2026-06-24 15:38:02", (None, 0, None, None),
        {"running_req": 1, "queue_req": 0, "num_token": 998080, "token_usage": 0.59,
         "gen_throughput_tok_s": 205.21, "cuda_graph": True}),
    87: ("decode", "2026-06-24 15:38:02", (None, 1, None, None),
        {"running_req": 1, "queue_req": 0, "num_token": 998080, "token_usage": 0.59,
         "gen_throughput_tok_s": 203.25, "cuda_graph": True}),
    88: ("decode", "2026-06-24 15:38:02", (None, 2, None, None),
        {"running_req": 1, "queue_req": 0, "num_token": 998080, "token_usage": 0.59,
         "gen_throughput_tok_s": 200.33, "cuda_graph": True}),
    89: ("decode", "2026-06-24 15:38:02", (None, 3, None, None),
        {"running_req": 1, "queue_req": 0, "num_token": 998080, "token_usage": 0.59,
         "gen_throughput_tok_s": 205.67, "cuda_graph": True}),
    90: ("decode", "2026-06-24 15:38:02", (None, 0, None, None),
        {"running_req": 3, "queue_req": 0, "num_token": 998144, "token_usage": 0.59,
         "gen_throughput_tok_s": 201.08, "cuda_graph": True}),
    91: ("decode", "2026-06-24 15:38:02", (None, 1, None, None),
        {"running_req": 3, "queue_req": 0, "num_token": 998144, "token_usage": 0.59,
         "gen_throughput_tok_s": 202.45, "cuda_graph": True}),
    93: ("prefill", "2026-07-04 04:31:24", (None, None, 0, None),
        {"running_req": 1, "queue_req": 97, "new_seq": 12, "new_token": 43008, "cached_token": 0,
         "token_usage": 0.14, "input_throughput_tok_s": 15734.14, "cuda_graph": False}),
    94: ("prefill", "2026-07-04 04:31:27", (None, None, 0, None),
        {"running_req": 13, "queue_req": 85, "new_seq": 12, "new_token": 43264, "cached_token": 0,
         "token_usage": 0.2, "input_throughput_tok_s": 14947.07, "cuda_graph": False}),
    95: ("prefill", "2026-07-04 04:31:30", (None, None, 0, None),
        {"running_req": 25, "queue_req": 73, "new_seq": 12, "new_token": 43008, "cached_token": 0,
         "token_usage": 0.27, "input_throughput_tok_s": 13410.89, "cuda_graph": False}),
    96: ("prefill", "2026-07-04 04:31:33", (None, None, 0, None),
        {"running_req": 37, "queue_req": 61, "new_seq": 12, "new_token": 43904, "cached_token": 0,
         "token_usage": 0.33, "input_throughput_tok_s": 15159.92, "cuda_graph": False}),
    97: ("prefill", "2026-07-04 04:31:36", (None, None, 0, None),
        {"running_req": 49, "queue_req": 49, "new_seq": 12, "new_token": 43008, "cached_token": 0,
         "token_usage": 0.4, "input_throughput_tok_s": 15985.33, "cuda_graph": False}),
    99: ("decode", "2026-08-23 09:05:37", (None, None, 0, 0),
        {"running_req": 1, "queue_req": 0, "num_token": 165376, "token_usage": 0.02,
         "gen_throughput_tok_s": 167.04, "cuda_graph": True}),
    100: ("prefill", "2026-08-23 09:05:54", (None, None, 0, 0),
        {"running_req": 0, "queue_req": 0, "new_seq": 1, "new_token": 256, "cached_token": 0,
         "token_usage": 0.0, "input_throughput_tok_s": 12.33, "cuda_graph": False}),
    101: None,
    102: ("prefill", "2026-08-23 09:06:04", (None, None, 0, 0),
        {"running_req": 0, "queue_req": 0, "new_seq": 1, "new_token": 8192, "cached_token": 0,
         "token_usage": 0.0, "input_throughput_tok_s": 824.28, "cuda_graph": False}),
    103: ("prefill", "2026-08-23 09:06:05", (None, None, 0, 0),
        {"running_req": 0, "queue_req": 0, "new_seq": 1, "new_token": 8192, "cached_token": 0,
         "token_usage": 0.0, "input_throughput_tok_s": 13663.01, "cuda_graph": False}),
}


def _real_lines() -> list[tuple[int, str]]:
    text = REAL_LINES.read_text(encoding="utf-8")
    return [(no, line) for no, line in enumerate(text.split("\n"), 1) if line and not line.startswith("# ")]


def test_every_real_line_is_listed() -> None:
    """The expectation table covers exactly the non-comment lines of the real-lines file."""
    assert sorted(no for no, _ in _real_lines()) == sorted(EXPECTED)


@pytest.mark.parametrize(
    ("line_no", "line"), _real_lines(), ids=lambda v: str(v) if isinstance(v, int) else ""
)
def test_real_line(line_no: int, line: str) -> None:
    """Each real pasted line is recognised with the right values, or not at all when it is no batch line."""
    parsed = parse_line(line, engine="sglang")
    expected = EXPECTED[line_no]
    if expected is None:
        assert parsed is None
        return
    kind, ts, ranks, fields = expected
    assert parsed is not None
    assert parsed.kind == kind
    assert parsed.ts_text == ts
    assert tuple(getattr(parsed, r) for r in RANKS) == ranks
    if kind == "config":
        assert parsed.config == fields
    else:
        assert parsed.values == fields


def test_mangled_paste_reads_only_intact_fields() -> None:
    """A line whose middle columns were cut keeps its intact fields and never misreads the cut ones."""
    line = (
        "[2026-05-28 02:59:52 TP0] Prefill batch, #new-seq: 1, #new-token: 896, "
        "#cached-tounning-req: 34, #queue-req: 92, #pending-token: 79469, npu graph: False, input th"
    )
    parsed = parse_line(line, engine="sglang")
    assert parsed is not None
    assert parsed.values == {"new_seq": 1, "new_token": 896, "queue_req": 92, "cuda_graph": False}


D = "Decode batch"
P = "Prefill batch"
# (line, kind, expected metric fields): one line per form in ENGINES.md's history.
HISTORY = [
    (
        "#running-req: 3, #token: 1200, token usage: 0.05, gen throughput (token/s): 88.10, #queue-req: 2",
        "decode",
        {
            "running_req": 3,
            "num_token": 1200,
            "token_usage": 0.05,
            "gen_throughput_tok_s": 88.1,
            "queue_req": 2,
        },
    ),
    (
        "#running-req: 1, #token: 20, token usage: 0.00, #queue-req: 0",
        "decode",
        {"running_req": 1, "num_token": 20, "token_usage": 0.0, "queue_req": 0},
    ),
    (
        "new fill batch. #seq: 2. #cached_token: 7. #new_token: 40. #remaining_req: 3. #running_req: 5. "
        "tree_cache_hit_rate: 14.89%",
        "prefill",
        {"new_seq": 2, "cached_token": 7, "new_token": 40, "queue_req": 3, "running_req": 5},
    ),
    (
        f"[gpu_id=1] {D}. #running-req: 4, #token: 900, token usage: 0.01, gen throughput (token/s): 50.00, "
        "#queue-req: 0",
        "decode",
        {
            "running_req": 4,
            "num_token": 900,
            "token_usage": 0.01,
            "gen_throughput_tok_s": 50.0,
            "queue_req": 0,
        },
    ),
    (
        "[gpu_id=0] Prefil batch. #new-seq: 1, #new-token: 10, #cached-token: 5, cache hit rate: 33.33%, "
        "#running-req: 0, #queue-req: 0",
        "prefill",
        {"new_seq": 1, "new_token": 10, "cached_token": 5, "running_req": 0, "queue_req": 0},
    ),
    (
        f"[2025-03-07 10:00:00 TP0] {P}. #new-seq: 1, #new-token: 8, #cached-token: 0, token usage: 0.00, "
        "#running-req: 0, #queue-req: 0, ",
        "prefill",
        {
            "new_seq": 1,
            "new_token": 8,
            "cached_token": 0,
            "token_usage": 0.0,
            "running_req": 0,
            "queue_req": 0,
        },
    ),
    (
        f"[2025-03-07 10:00:00 TP0] {D}. #running-req: 5, #token: 100, token usage: 0.00, largest-len: 0, "
        "gen throughput (token/s): 20.00, #queue-req: 0, ",
        "decode",
        {
            "running_req": 5,
            "num_token": 100,
            "token_usage": 0.0,
            "gen_throughput_tok_s": 20.0,
            "queue_req": 0,
        },
    ),
    (
        f"[2025-05-01 10:00:00 TP0] {D}. #running-req: 5, #token: 100, token usage: 0.00, cuda graph: True, "
        "gen throughput (token/s): 20.00, #queue-req: 0",
        "decode",
        {
            "running_req": 5,
            "num_token": 100,
            "token_usage": 0.0,
            "cuda_graph": True,
            "gen_throughput_tok_s": 20.0,
            "queue_req": 0,
        },
    ),
    (
        f"[2025-10-20 10:00:00 PP1] {P} [12], #new-seq: 3, #new-token: 30, #cached-token: 1, "
        "token usage: 0.10, "
        "#running-req: 2, #queue-req: 9, ",
        "prefill",
        {
            "new_seq": 3,
            "new_token": 30,
            "cached_token": 1,
            "token_usage": 0.1,
            "running_req": 2,
            "queue_req": 9,
        },
    ),
    (
        f"[2025-10-20 10:00:00 PP1] {D} [13], #running-req: 8, #token: 80, token usage: 0.10, "
        "cuda graph: True, "
        "gen throughput (token/s): 99.50, #queue-req: 1, ",
        "decode",
        {
            "running_req": 8,
            "num_token": 80,
            "token_usage": 0.1,
            "cuda_graph": True,
            "gen_throughput_tok_s": 99.5,
            "queue_req": 1,
        },
    ),
    (
        f"[2026-04-10 10:00:00] {P}, #new-seq: 1, #new-token: 64, #cached-token: 10048, token usage: 0.00, "
        "#running-req: 0, #queue-req: 0, #pending-token: 0, #bootstrap-req: 0, #inflight-req: 1, "
        "cuda graph: False, "
        "input throughput (token/s): 178.18, est. prefill TFLOPS/s (per GPU): 9.90, fwd occupancy: nan%",
        "prefill",
        {
            "new_seq": 1,
            "new_token": 64,
            "cached_token": 10048,
            "token_usage": 0.0,
            "running_req": 0,
            "queue_req": 0,
            "cuda_graph": False,
            "input_throughput_tok_s": 178.18,
        },
    ),
    (
        f"[2026-04-10 10:00:00] {D}, #running-req: 18, #token: 16384, token usage: 0.71, accept len: 2.40, "
        "accept rate: 0.84, pre-allocated usage: 0.10, #prealloc-req: 2, #transfer-req: 1, "
        "#retracted-req: 0, "
        "cpu graph: False, gen throughput (token/s): 500.00, #queue-req: 3, "
        "est. decode TFLOPS/s (per GPU): 12.34, "
        "est. read BW (GB/s per GPU): 456.78, fwd occupancy: 87.50%",
        "decode",
        {
            "running_req": 18,
            "num_token": 16384,
            "token_usage": 0.71,
            "cuda_graph": False,
            "gen_throughput_tok_s": 500.0,
            "queue_req": 3,
        },
    ),
    (
        f"[2026-04-10 10:00:00] {D}, #running-req: 4, #token: 1000, token usage: 0.10, mamba num: 4, "
        "mamba usage: 0.20, musa graph: True, gen throughput (token/s): 10.00, #queue-req: 0",
        "decode",
        {
            "running_req": 4,
            "num_token": 1000,
            "token_usage": 0.1,
            "cuda_graph": True,
            "gen_throughput_tok_s": 10.0,
            "queue_req": 0,
        },
    ),
    (
        f"[2026-04-10 10:00:00] {D}, #running-req: 2, #full token: 300, full token usage: 0.03, "
        "#swa token: 20, "
        "swa token usage: 0.01, npu graph: True, gen throughput (token/s): 5.00, #queue-req: 0",
        "decode",
        {
            "running_req": 2,
            "num_token": 300,
            "token_usage": 0.03,
            "cuda_graph": True,
            "gen_throughput_tok_s": 5.0,
            "queue_req": 0,
        },
    ),
    (
        f"[2026-04-10 10:00:00] {D}, #running-req: 2, #token: 30, #cached-token: 12, token usage: 0.03, "
        "cuda graph: True, gen throughput (token/s): 5.00, #queue-req: 0",
        "decode",
        {
            "running_req": 2,
            "num_token": 30,
            "cached_token": 12,
            "token_usage": 0.03,
            "cuda_graph": True,
            "gen_throughput_tok_s": 5.0,
            "queue_req": 0,
        },
    ),
]


@pytest.mark.parametrize(("line", "kind", "fields"), HISTORY)
def test_history_form(line: str, kind: str, fields: dict[str, object]) -> None:
    """Every historical batch-line form is recognised with its fields by name, unknown ones ignored."""
    parsed = parse_line(line, engine="sglang")
    assert parsed is not None
    assert parsed.kind == kind
    assert parsed.values == fields


@pytest.mark.parametrize(
    ("prefix", "ranks"),
    [
        ("[2026-01-02 03:04:05]", (None, None, None, None)),
        ("[2026-01-02 03:04:05 TP3]", (None, None, 3, None)),
        ("[2026-01-02 03:04:05 TP0 PP1]", (None, 1, 0, None)),
        ("[2026-01-02 03:04:05 PP1 TP0]", (None, 1, 0, None)),
        ("[2026-01-02 03:04:05 DP2 TP5 EP5 PP3]", (2, 3, 5, 5)),
        ("[2026-01-02 03:04:05 DP2 PP3 ATTN_CP1 MOE_DP4 TP5 EP6]", (2, 3, 5, 6)),
        ("[2026-01-02 03:04:05 EP6 MOE_DP4 PP7]", (None, 7, None, 6)),
        ("2026-01-02T03:04:05.123456789Z stdout F [2026-01-02 03:04:05 PP2]", (None, 2, None, None)),
        ("2026-01-02T04:04:05.12+01:00 stderr P [2026-01-02 03:04:05 PP2 TP1]", (None, 2, 1, None)),
        ("2026-01-02T03:04:05.000000000Z [2026-01-02 03:04:05 PP4]", (None, 4, None, None)),
        ("2026-01-02 03:04:05 INFO 8900 [ DP1 TP1 EP1 scheduler_metrics_mixin.py:222]", (1, None, 1, 1)),
    ],
)
def test_prefix_ranks_any_subset_any_order(prefix: str, ranks: tuple[int | None, ...]) -> None:
    """Ranks are read by name from any subset in any order, behind any container-runtime prefix."""
    line = (
        f"{prefix} {D}, #running-req: 8, #token: 10, token usage: 0.01, cuda graph: True, "
        "gen throughput (token/s): 1.00, #queue-req: 0"
    )
    parsed = parse_line(line, engine="sglang")
    assert parsed is not None
    assert tuple(getattr(parsed, r) for r in RANKS) == ranks
    assert parsed.ts_text == "2026-01-02 03:04:05"
    assert parsed.log_ts_ns == int(dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC).timestamp()) * 10**9
    assert parsed.ts_resolution_ns == 10**9
    assert parsed.values["running_req"] == 8


def _decode(prefix: str) -> str:
    return (
        f"{prefix} {D}, #running-req: 1, #token: 2, token usage: 0.00, cuda graph: True, "
        "gen throughput (token/s): 1.00, #queue-req: 0"
    )


def test_millisecond_timestamp() -> None:
    """SGLANG_LOG_MS=1 stamps (.mmm) keep their milliseconds at 1 ms resolution."""
    parsed = parse_line(_decode("[2026-01-02 03:04:05.678 PP1]"), engine="sglang")
    assert parsed is not None
    assert parsed.ts_text == "2026-01-02 03:04:05.678"
    base = int(dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC).timestamp()) * 10**9
    assert parsed.log_ts_ns == base + 678_000_000
    assert parsed.ts_resolution_ns == 10**6
    assert parsed.pp_rank == 1


def test_time_only_stamp_needs_a_date() -> None:
    """%H:%M:%S stamps (before 2024-10) get a time only when the caller supplies the date."""
    line = _decode("[10:28:25 TP3]")
    alone = parse_line(line, engine="sglang")
    assert alone is not None and alone.ts_text == "10:28:25" and alone.log_ts_ns is None
    dated = parse_line(line, engine="sglang", date="2024-09-01")
    assert dated is not None and dated.tp_rank == 3
    assert dated.log_ts_ns == int(dt.datetime(2024, 9, 1, 10, 28, 25, tzinfo=dt.UTC).timestamp()) * 10**9


def test_timezone_of_the_log() -> None:
    """Logged local times are converted with the given timezone, daylight saving included."""
    line = _decode("[2026-07-01 12:00:00 PP0]")
    parsed = parse_line(line, engine="sglang", tz="Europe/Berlin")
    assert parsed is not None
    assert parsed.log_ts_ns == int(dt.datetime(2026, 7, 1, 10, 0, 0, tzinfo=dt.UTC).timestamp()) * 10**9
    with pytest.raises(UsageError):
        LogClock("Not/AZone")


def test_gpu_tags() -> None:
    """[gpu=N] and [gpu_id=N] message tags (2024) give the rank of the GPU that logged."""
    for tag in ("[gpu=5]", "[gpu_id=5]"):
        parsed = parse_line(
            f"{tag} {D}. #running-req: 1, #token: 2, token usage: 0.00, #queue-req: 0", engine="sglang"
        )
        assert parsed is not None and parsed.tp_rank == 5 and parsed.log_ts_ns is None


@pytest.mark.parametrize(
    "line",
    [
        "[2025-03-07 09:31:43 TP6] Capture cuda graph end. Time elapsed: 391.00 s",
        '[2025-09-03 18:33:31] INFO:     192.168.30.81:35262 - "POST /v1/chat/completions HTTP/1.1" 200 OK',
        "[2026-01-02 03:04:05 TP0] Decode batch size 8 is smaller than expected",
        "[2026-01-02 03:04:05 TP0] KV cache pool is full. Retract requests. #retracted_reqs: 1, "
        "#new_token_ratio: 0.3",
        "[2026-01-02 03:04:05 TP0] Prefill batch, nothing to see",
        "[2026-01-02 03:04:05 TP0] Load weight end. type=LlamaForCausalLM, dtype=torch.bfloat16, "
        "avail mem=30.2 GB",
        "user said: the #running-req: 3 number looks odd",
        "",
    ],
)
def test_other_lines_are_not_misread(line: str) -> None:
    """Lines that merely resemble batch lines are not recognised."""
    assert parse_line(line, engine="sglang") is None


def test_max_total_num_tokens_line() -> None:
    """The startup capacity line becomes an EngineConfig with every field by its SGLang name."""
    line = (
        "[2025-03-07 09:31:43 TP0] max_total_num_tokens=201681, chunked_prefill_size=8192, "
        "max_prefill_tokens=16384, max_running_requests=2049, context_len=163840, available_gpu_mem=73.60 GB"
    )
    parser = LogParser(host="n0", source="s.log")
    record = parser.feed(line)
    assert isinstance(record, EngineConfig)
    assert (record.max_total_num_tokens, record.chunked_prefill_size, record.max_running_requests) == (
        201681,
        8192,
        2049,
    )
    assert record.pp_size is None
    assert json.loads(record.fields_json) == {
        "max_total_num_tokens": 201681,
        "chunked_prefill_size": 8192,
        "max_prefill_tokens": 16384,
        "max_running_requests": 2049,
        "context_len": 163840,
        "available_gpu_mem": "73.60 GB",
    }


def test_server_args_line() -> None:
    """server_args=ServerArgs(...) gives sizes, caps and intervals, nested values kept as logged."""
    line = (
        "[2026-01-02 03:04:05] server_args=ServerArgs(model_path='/models/Llama-3.1-70B', "
        "tokenizer_mode='auto', tp_size=2, pp_size=8, dp_size=1, max_running_requests=64, "
        "pp_max_micro_batch_size=None, pp_async_batch_depth=1, chunked_prefill_size=4096, "
        "decode_log_interval=1, json_model_override_args='{\"a\": [1, 2]}', "
        "lora_paths=['x', 'y'], speculative_config=SpecConfig(num_steps=3, algo='eagle'), "
        "dtype='auto', enable_metrics=True, base_gpu_id=0)"
    )
    record = LogParser(host="n0", source="s.log").feed(line)
    assert isinstance(record, EngineConfig)
    assert (record.tp_size, record.pp_size, record.dp_size) == (2, 8, 1)
    assert (record.max_running_requests, record.pp_max_micro_batch_size) == (64, None)
    assert (record.pp_async_batch_depth, record.chunked_prefill_size, record.decode_log_interval) == (
        1,
        4096,
        1,
    )
    fields = json.loads(record.fields_json)
    assert fields["model_path"] == "/models/Llama-3.1-70B"
    assert fields["lora_paths"] == ["x", "y"]
    assert fields["json_model_override_args"] == '{"a": [1, 2]}'
    assert fields["speculative_config"] == "SpecConfig(num_steps=3, algo='eagle')"
    assert fields["enable_metrics"] is True


def test_server_args_dict_line() -> None:
    """SGLang 0.5.x logs the resolved arguments as a dict (``server_args={...}``): the same fields
    are read; values that are object reprs are kept as logged."""
    line = (
        "[2026-12-01 09:08:28] server_args={'model_path': '/work/model', 'tokenizer_mode': 'auto', "
        "'tp_size': 1, 'pp_size': 2, 'dp_size': 1, 'max_running_requests': 8, "
        "'pp_max_micro_batch_size': 16, 'pp_async_batch_depth': 0, 'chunked_prefill_size': 8192, "
        "'decode_log_interval': 1, 'lora_paths': ['x', 'y'], 'json_model_override_args': '{\"a\": 1}', "
        "'speculative': <SpecConfig object at 0x7f>, 'enable_metrics': True, 'nested': {'a': [1, 2]}}"
    )
    record = LogParser(host="n0", source="s.log").feed(line)
    assert isinstance(record, EngineConfig)
    assert (record.tp_size, record.pp_size, record.dp_size) == (1, 2, 1)
    assert (record.max_running_requests, record.pp_max_micro_batch_size) == (8, 16)
    assert (record.pp_async_batch_depth, record.chunked_prefill_size, record.decode_log_interval) == (
        0, 8192, 1)
    fields = json.loads(record.fields_json)
    assert fields["lora_paths"] == ["x", "y"]
    assert fields["json_model_override_args"] == '{"a": 1}'
    assert fields["speculative"] == "<SpecConfig object at 0x7f>"
    assert fields["nested"] == {"a": [1, 2]} and fields["enable_metrics"] is True


def test_server_args_old_micro_batch_flag() -> None:
    """Before 2025-10 the cap was logged as max_micro_batch_size; it fills pp_max_micro_batch_size."""
    record = LogParser(host="n0", source="s").feed(
        "[2025-06-01 00:00:00] server_args=ServerArgs(pp_size=4, max_micro_batch_size=16)"
    )
    assert isinstance(record, EngineConfig)
    assert (record.pp_size, record.pp_max_micro_batch_size) == (4, 16)


def test_log_parser_counts_numbers_and_stamps() -> None:
    """LogParser numbers lines, counts per kind and unrecognised, and keeps a live receive time."""
    parser = LogParser(host="n0", source="live", first_line_no=10)
    lines = [
        _decode("[2026-01-02 03:04:05 PP0]"),
        "noise",
        _decode("[2026-01-02 03:04:06 PP1]") + "\n",
        "[2026-01-02 03:04:06] max_total_num_tokens=100, max_running_requests=8",
    ]
    records = [parser.feed(line, recv_ts_ns=123) for line in lines]
    assert records[1] is None
    assert isinstance(records[0], SchedulerEvent) and isinstance(records[2], SchedulerEvent)
    assert (records[0].line_no, records[2].line_no) == (10, 12)
    assert records[2].recv_ts_ns == 123 and records[2].pp_rank == 1
    assert (records[2].host, records[2].source, records[2].engine) == ("n0", "live", "sglang")
    assert isinstance(records[3], EngineConfig) and records[3].line_no == 13
    assert parser.counts.as_dict() == {
        "lines": 4,
        "recognised": {"prefill": 0, "decode": 2, "config": 1, "stats": 0},
        "unrecognised": 1,
    }


def test_invalid_date_is_none_not_an_error() -> None:
    """An impossible (or int64-overflowing) logged date gives log_ts_ns None and still the event."""
    for stamp in ("2026-13-45 25:61:00", "0026-06-24 15:38:02", "9999-01-01 00:00:00"):
        parsed = parse_line(_decode(f"[{stamp} PP0]"), engine="sglang")
        assert parsed is not None and parsed.log_ts_ns is None and parsed.pp_rank == 0


def test_absurd_numbers_are_none() -> None:
    """A count too long for the store's integers is None, not an overflow later."""
    parsed = parse_line(f"{D}, #running-req: 1234567890123456789012, #token: 5", engine="sglang")
    assert parsed is not None and parsed.values == {"num_token": 5}


_REAL = [line for _, line in _real_lines()]


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_random_text_never_raises(text: str) -> None:
    """Arbitrary text never makes the grammar raise."""
    clock = LogClock(date=dt.date(2025, 1, 1))
    result = sglang.parse_line(text, clock)
    assert result is None or result.kind in ("prefill", "decode", "config")


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(_REAL), st.data())
def test_mutated_real_lines_never_raise(line: str, data: st.DataObject) -> None:
    """Real lines cut, spliced and overwritten at random never make the grammar raise."""
    start = data.draw(st.integers(0, len(line)))
    stop = data.draw(st.integers(start, len(line)))
    insert = data.draw(
        st.text(alphabet=st.sampled_from(list(",.:#[] 0123456789-=()'\"TrueFalsePDE\\\n")), max_size=20)
    )
    mutated = line[:start] + insert + line[stop:]
    clock = LogClock(date=dt.date(2025, 1, 1))
    result = sglang.parse_line(mutated, clock)
    assert result is None or result.kind in ("prefill", "decode", "config")
    LogParser(host="h", source="s").feed(mutated)


def test_a_setting_past_int64_is_not_a_setting() -> None:
    """`max_total_num_tokens=99999999999999999999999` (seen stopping a collector's writer): the typed
    field is None, the other settings of the line are read, the value stays in fields_json."""
    record = LogParser(host="n0", source="s").feed(
        "[2026-01-01 00:00:00 PP0] max_total_num_tokens=99999999999999999999999, max_running_requests=8")
    assert isinstance(record, EngineConfig)
    assert (record.max_total_num_tokens, record.max_running_requests) == (None, 8)
    assert json.loads(record.fields_json)["max_total_num_tokens"] == 99999999999999999999999
