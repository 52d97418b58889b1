"""The recorded real-engine fixtures (tests/data/engines/<engine>-<version>-pp2/<setting>/, made
by `make engine-fixtures`): where they are, and what a log's lines look like to gputrace's grammar
(for the engine tier's format-drift check)."""

from __future__ import annotations

import json
from pathlib import Path

from engine_servers import FIXTURE_ONLY_SETTINGS, SETTINGS, EngineSetting

from gputrace.engines import LogParser
from gputrace.model import RequestRecord

FIXTURES = Path(__file__).resolve().parent / "data" / "engines"


def setting(engine: str, name: str) -> EngineSetting:
    for s in (*SETTINGS, *FIXTURE_ONLY_SETTINGS):
        if s.engine == engine and s.name == name:
            return s
    raise KeyError(f"no recorded setting {engine}/{name}")


def fixture_dir(engine: str, name: str) -> Path:
    return FIXTURES / setting(engine, name).fixture_name / name


def line_signature(engine: str, text: str) -> set[tuple[str, tuple[str, ...]]]:
    """Each recognised line's kind with the fields it carried (ranks, values, config keys)."""
    parser = LogParser(host="h", source="s", engine=engine, date="2026-01-01")
    out: set[tuple[str, tuple[str, ...]]] = set()
    for line in text.splitlines():
        parsed = parser.parse(line)
        if parsed is None:
            continue
        ranks = ("dp_rank", "pp_rank", "tp_rank", "ep_rank")
        present = [name for name in ranks if getattr(parsed, name) is not None]
        present += sorted(parsed.values)
        if parsed.config is not None:
            present += ["config"]
        out.add((parsed.kind, tuple(present)))
    return out


def client_requests(engine: str, name: str) -> list[RequestRecord]:
    """The fixture's request records as the load generator wrote them."""
    out = []
    for line in (fixture_dir(engine, name) / "requests.jsonl").read_text().splitlines():
        obj = json.loads(line)
        if obj.pop("type") == "request":
            out.append(RequestRecord(**obj))
    return out


def metrics_series(engine: str, name: str, metric: str, **labels: str) -> list[tuple[int, float]]:
    """(ts_ns, value) of one watched series in the fixture's /metrics scrapes."""
    out = []
    for line in (fixture_dir(engine, name) / "metrics.ndjson").read_text().splitlines():
        snap = json.loads(line)
        values = [s["value"] for s in snap["samples"]
                  if s["name"] == metric and all(s["labels"].get(k) == v for k, v in labels.items())]
        if values:
            out.append((int(snap["ts_ns"]), float(sum(values))))
    return out
