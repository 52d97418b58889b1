"""Each engine in its own words: on the recorded real runs (tests/data/engines/), what a user reads
of a vLLM run (the report in HTML, Markdown and findings.json, the advice, `whatif`, `watch`'s
view and the Grafana dashboard's panels) names no SGLang flag, setting or log field, and an SGLang
run's none of vLLM's. The words come from the engine modules (``EngineWords``), not from a list
kept here."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from engine_fixtures import fixture_dir
from helpers import json_strings
from rich.console import Console

from gputrace import dashboard
from gputrace.engines import ENGINE_WORDS, LogParser, foreign_words
from gputrace.live import LiveState
from gputrace.model import EngineConfig
from gputrace.watch import render_status

ENGINES = ("vllm", "sglang")


def _gputrace(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gputrace", *args], capture_output=True, text=True,
                          timeout=300)


def _date(engine: str) -> str:
    args = json.loads((fixture_dir(engine, "default") / "args.json").read_text())
    return str(args["recorded_utc"])[:10]


def _watch_screen(engine: str) -> str:
    """`watch`'s view of the live state the collector builds from the run's log lines."""
    where = fixture_dir(engine, "default")
    parser = LogParser(host="engine-host", source="log", engine=engine, date=_date(engine))
    records = [r for line in (where / "engine.log").read_text().splitlines()
               if (r := parser.feed(line)) is not None]
    # the view as it stood a second after the longest queue was logged (C=16, at the pool)
    busiest = max((r for r in records if not isinstance(r, EngineConfig) and r.log_ts_ns is not None),
                  key=lambda r: r.queue_req or 0)
    assert busiest.log_ts_ns is not None and (busiest.queue_req or 0) > 0
    now = busiest.log_ts_ns + 1_000_000_000
    state = LiveState("recorded", clock_ns=lambda: now)
    for r in records:
        if r.log_ts_ns is not None and r.log_ts_ns > now:
            break
        if isinstance(r, EngineConfig):
            state.on_config(r)
        else:
            state.on_event(r if r.log_ts_ns is None else
                           type(r)(**{**{f: getattr(r, f) for f in r.__slots__}, "recv_ts_ns": r.log_ts_ns}))
    console = Console(record=True, width=200, file=io.StringIO())
    console.print(render_status(state.status()))
    return console.export_text()


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    """Per engine, each output as the user reads it, by its name."""
    out: dict[str, dict[str, str]] = {}
    for engine in ENGINES:
        where = fixture_dir(engine, "default")
        run = tmp_path_factory.mktemp(engine) / "run"
        done = _gputrace("import", "--run", str(run), "--host", "engine-host", f"--{engine}-log",
                         str(where / "engine.log"), "--requests", str(where / "requests.jsonl"),
                         "--no-progress", "--date", _date(engine))
        assert done.returncode == 0, done.stderr[-2000:]
        report = _gputrace("report", str(run), "--no-progress")
        assert report.returncode == 0, report.stderr[-2000:]
        pool = ENGINE_WORDS[engine].setting("max_running_requests")
        whatif = _gputrace("whatif", str(run), "--set", f"{pool}=16")
        assert whatif.returncode == 0, whatif.stderr[-2000:]
        findings = json.loads((run / "report" / "findings.json").read_text())
        out[engine] = {
            "report.md": (run / "report" / "report.md").read_text(),
            "report.html": (run / "report" / "report.html").read_text(),
            "findings.json": "\n".join(json_strings(findings)),
            "advice": "\n".join(json_strings(findings.get("advice"))),
            "whatif": whatif.stdout + whatif.stderr,
            "watch": _watch_screen(engine),
        }
    return out


def _found(words: frozenset[str], text: str) -> list[str]:
    """The words standing as words in the text (a flag not inside a longer flag, a field name not
    inside a longer name)."""
    return sorted(w for w in words
                  if re.search(rf"(?<![\w#-]){re.escape(w)}(?![\w-])", text))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("output", ["report.md", "report.html", "findings.json", "advice", "whatif", "watch"])
def test_a_runs_outputs_speak_its_engines_words_only(outputs: dict[str, dict[str, str]], engine: str,
                                                      output: str) -> None:
    """No flag, setting name or log field of another engine in what the run's outputs show."""
    text = outputs[engine][output]
    assert text.strip()
    leaks = [f"{w!r} in ...{text[max(m.start() - 60, 0):m.end() + 30]!r}..."
             for w in _found(foreign_words(engine), text) if (m := re.search(re.escape(w), text))]
    assert leaks == [], "\n".join(leaks)


def test_the_outputs_name_the_engines_own_admission_flag(outputs: dict[str, dict[str, str]]) -> None:
    """The C=16 phase waits at the admission limit: each run's report and advice name its own flag."""
    for engine in ENGINES:
        flag = ENGINE_WORDS[engine].flag("max_running_requests")
        assert flag is not None
        assert flag in outputs[engine]["report.md"] and flag in outputs[engine]["advice"], engine


def test_the_dashboards_panels_name_no_engines_words() -> None:
    """One dashboard serves every engine: its titles, descriptions and legends are in neither's words."""
    panels = json.loads(Path(dashboard.DASHBOARD_PATH).read_text())["panels"]
    text = "\n".join(json_strings(panels))
    every = frozenset(w for words in ENGINE_WORDS.values() for w in words.vocabulary())
    assert _found(every, text) == []


def test_the_word_lists_hold_each_engines_flags() -> None:
    """The words checked are the engines' own: SGLang's K flag and log field, vLLM's admission flag."""
    assert {"--pp-max-micro-batch-size", "#running-req", "pp_max_micro_batch_size",
            "--chunked-prefill-size", "--decode-log-interval"} <= foreign_words("vllm")
    assert {"--max-num-seqs", "max_num_seqs", "--max-num-batched-tokens"} <= foreign_words("sglang")
    assert _found(frozenset({"--max-running-requests"}), "pool (--max-running-requests 8)")
    assert not _found(frozenset({"#token"}), "#tokens")
