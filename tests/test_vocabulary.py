"""The shared records read back from the JSON they travel as (meta.json, /v1/status)."""

from __future__ import annotations

import json

from gputrace.json_types import JsonObject
from gputrace.vocabulary import CaptureProblem, LiveStatus


def _status() -> LiveStatus:
    return LiveStatus("run-1", "C=8", 8, 7.5, {"log_lines": 120}, ({"pp_rank": 0, "busy_ratio": 0.5},),
                      {"writing": True}, (CaptureProblem("log", "no lines", 10, None),), 2,
                      {"running": 8.0}, "pipeline_underfilled: ...", 2_000, 1_500)


def test_a_status_survives_its_json() -> None:
    """What the collector serves at /v1/status, `watch` reads back as the same status."""
    body = json.loads(json.dumps(_status().to_dict()))
    assert LiveStatus.from_dict(body) == _status()


def test_a_status_field_not_of_its_type_is_unknown() -> None:
    """A field of another type (another version's collector, a proxy's reply) is read as unknown,
    a row that is no object is left out: none reaches the renderer as something else."""
    body: JsonObject = {**_status().to_dict(), "run": 3, "inflight": "7.5", "counts": {"log_lines": "120"},
                        "stages": [1, {"pp_rank": 0}], "pp_size": True, "problems": ["gap"], "engine": [],
                        "now_ns": 2.5}
    read = LiveStatus.from_dict(body)
    assert (read.run, read.inflight, read.counts, read.pp_size, read.engine, read.now_ns) == \
        (None, None, {}, None, None, None)
    assert read.stages == ({"pp_rank": 0},) and read.problems == ()
    assert read.phase == "C=8" and read.newest_data_ns == 1_500


def test_a_capture_problem_time_that_is_no_number_is_unknown() -> None:
    """meta.json's problem with a time that is no number keeps its source and reason."""
    problem = CaptureProblem.from_dict({"source": "log", "reason": "no lines", "since_ns": [1],
                                        "until_ns": 20})
    assert problem == CaptureProblem("log", "no lines", None, 20)
