"""[engines] Must show 2: a third engine, test-only (ToyServe, tests/toy_engine/: a made-up log
grammar, its knob, its policy), added as one package and one registration with no change to
gputrace: its log is parsed, diagnosed, advised and reported through the path SGLang's takes
(the import's ingest_log, analyse_run with the advisor, write_report), in its own words."""

from __future__ import annotations

import datetime as dt
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import toy_engine
from helpers import json_strings

from gputrace.analyse import analyse_run
from gputrace.engines import ENGINE_WORDS, foreign_words, grammar
from gputrace.imports.engine_log import ingest_log
from gputrace.report.render import write_report
from gputrace.store import Store
from gputrace.whatif.advise import advisor

START = dt.datetime(2026, 12, 1, 9, 0, tzinfo=dt.UTC)
LEVELS = ((4, 4, 0, 96.0), (16, 8, 8, 160.0))  # (offered, running, waiting, tok/s)
LEVEL_S = 90


def _toy_log(path: Path) -> None:
    """A ToyServe run at two levels against its max_batch of 8: the second waits for the limit."""
    lines = [f"[toy {START:%Y-%m-%d %H:%M:%S}.000] config pp=2 max_batch=8 model=toy-1b"]
    t = 1
    for _, running, waiting, tok_s in LEVELS:
        for _ in range(LEVEL_S):
            at = START + dt.timedelta(seconds=t)
            lines.append(f"[toy {at:%Y-%m-%d %H:%M:%S}.000] step running={running} waiting={waiting} "
                         f"gen_tok_s={tok_s} kv=0.20")
            t += 1
    for _ in range(10):  # idle after the load
        at = START + dt.timedelta(seconds=t)
        lines.append(f"[toy {at:%Y-%m-%d %H:%M:%S}.000] step running=0 waiting=0 gen_tok_s=0.0 kv=0.00")
        t += 1
    path.write_text("\n".join(["some other line the engine prints", *lines]) + "\n")


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """ToyServe registered (the one registration a new engine needs), for this test only."""
    assert "toy" not in ENGINE_WORDS
    # gputrace.engines.register(toy_engine.ENGINE), undone when the test ends
    monkeypatch.setitem(ENGINE_WORDS, toy_engine.KIND, toy_engine.ENGINE)
    yield


def test_a_third_engine_goes_through_the_same_path(tmp_path: Path, toy: None) -> None:
    """Its log imported, analysed with the advisor and reported: the admission bound found and
    named in its flag (--max-batch 16), the report in its words, no other engine's."""
    assert ENGINE_WORDS["toy"] is toy_engine.ENGINE and grammar("toy") is toy_engine.parse_line
    log = tmp_path / "toy.log"
    _toy_log(log)
    with Store.create(tmp_path / "run") as store:
        stats = ingest_log(store, log, host="toy-host", engine="toy")
    assert stats.recognised["stats"] == 2 * LEVEL_S + 10 and stats.recognised["config"] == 1
    with Store.open(tmp_path / "run", read_only=True) as store:
        analysis = analyse_run(store, advise=advisor())
    assert analysis.run.engine.kind == "toy" and analysis.run.engine.admission_limit == 8
    assert analysis.run.pp_size == 2
    bound = [f for f in analysis.findings if f.cause == "admission_bound"]
    assert bound and bound[0].recommendation.startswith("--max-batch 16"), analysis.findings
    assert analysis.advice is not None
    write_report(analysis, tmp_path / "report", ("md", "json"))
    doc = json.loads((tmp_path / "report" / "findings.json").read_text())
    assert any(f["change"] and f["change"]["knob"] == "--max-batch" for f in doc["findings"])
    assert [c["flag"] for c in doc["advice"]["changes"]] in ([], ["--max-batch"]), doc["advice"]
    report = (tmp_path / "report" / "report.md").read_text()
    assert "--max-batch 16" in report and "stage mapping: engine config + ToyServe rank order" in report
    assert "engine: max_batch=8" in report  # the engine line, in its own setting's name
    # what the user reads (the report, and findings.json's texts: its keys are gputrace's schema)
    text = report + "\n".join(json_strings(doc))
    leaked = sorted(w for w in foreign_words("toy")
                    if re.search(rf"(?<![\w#-]){re.escape(w)}(?![\w-])", text))
    assert leaked == [], leaked



def test_the_simulator_runs_a_third_engines_policy_and_asks_it_for_its_log(toy: None) -> None:
    """The simulator takes ToyServe's scheduling policy, slots and knobs from its package (engine-wide
    admission at max_batch, no per-slot K); ToyServe's package gives no simulated log, so a run that
    writes one is a one-line error naming it, where a what-if's run without a log goes on."""
    from gputrace.errors import UsageError
    from gputrace.sim.virtual import run_scenario

    load = {"engine": "toy", "max_running_requests": 4, "concurrency": (16,), "phase_s": 10.0,
            "drain_s": 1.0}
    result = run_scenario("healthy", overrides=load, log=False)
    assert result.params.slots == result.params.pp_size and result.params.micro_batch_cap == 4
    [phase] = result.ground_truth["phases"]
    assert phase["running_max"] == 4 and "admission_bound" in phase["causes"]
    with pytest.raises(UsageError, match=r"^the simulator does not write ToyServe's log$"):
        run_scenario("healthy", overrides=load)
