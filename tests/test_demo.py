"""`gputrace demo --quick`: the whole chain as real processes, three runs of the motivating
deployment (defaults, gputrace's own top recommendation applied, K = 64), their reports and the
comparisons ([diagnosis] Must show 4)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gputrace.demo import FIRST_TRY, SCENARIO, DemoPlan, run_one, top_recommendation
from gputrace.store import Store


def _phases(doc: dict) -> dict[str, float]:  # type: ignore[type-arg]
    return {p["label"]: p["throughput_tok_s"] for p in doc["phases"]}


@pytest.mark.slow
def test_quick_demo_applies_its_own_recommendation(tmp_path: Path) -> None:
    """The defaults' findings name a change with a value; the second run applies exactly that (as
    its log's configuration says) and is faster at the phase the finding named; the K = 64 run
    runs with K 64; the table and the recommendation's measured effect are printed."""
    out = tmp_path / "demo"
    done = subprocess.run([sys.executable, "-m", "gputrace", "demo", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    docs = {run: json.loads((out / run / "report" / "findings.json").read_text())
            for run in ("defaults", "recommended", "k64")}
    rec = top_recommendation(docs["defaults"])
    assert rec is not None and rec.knob == "--pp-max-micro-batch-size"
    assert rec.cause == "pipeline_underfilled"  # the default K bunches the load below 64
    assert 1 <= rec.value < 8
    # the recommended run's engine logged the recommended setting, the first try K = 64
    assert docs["recommended"]["summary"]["engine"]["pp_max_micro_batch_size"] == rec.value
    assert docs["k64"]["summary"]["engine"]["pp_max_micro_batch_size"] == FIRST_TRY["pp_max_micro_batch_size"]
    # every engine logged every decode step, as the README asks: no sampling caveat in a report
    for run, doc in docs.items():
        assert doc["summary"]["engine"]["decode_log_interval"] == 1, run
        assert not any("decode lines are logged every" in note for note in doc["notes"]), run
    # a client that leaves mid-stream (the load's last level ending) is no error in the server's log
    for run in docs:
        assert "Traceback" not in (out / "work" / run / "sim.out").read_text(), run
    before, after = _phases(docs["defaults"])[rec.phase], _phases(docs["recommended"])[rec.phase]
    assert after > before, (rec, before, after)
    gain = after / before - 1
    assert f"at {rec.phase} ({gain:+.0%})" in done.stdout.replace("\n", " ")
    assert "vs defaults" in done.stdout
    # [whatif]: the prediction made from the defaults' run, printed beside the measured gain
    assert rec.predicted is not None and "predicted before the rerun" in done.stdout
    for run in docs:
        assert (out / run / "report" / "report.html").stat().st_size > 10_000
    assert any((out / "compare-defaults-recommended").iterdir())
    assert any((out / "compare-defaults-k64").iterdir())


@pytest.mark.slow
def test_demo_run_over_two_nodes(tmp_path: Path) -> None:
    """`demo --nodes 2`'s run: the PP8 engine over two simulated nodes, each its own log and
    agent; the store holds stages 0-3 from sim-node0 and 4-7 from sim-node1, GPUs 0-3 on each,
    and the report's mapping says so."""
    plan = DemoPlan(concurrency=(8,), level_s=4.0, max_tokens=64, nodes=2)
    run = run_one(tmp_path, "two-nodes", SCENARIO, plan, lambda _: None)
    with Store.open(run.run_dir, read_only=True) as store:
        stages = dict(store.sql("SELECT host, list(DISTINCT pp_rank ORDER BY pp_rank) FROM scheduler_events "
                                "GROUP BY host"))
        gpus = dict(store.sql("SELECT host, list(DISTINCT gpu_index ORDER BY gpu_index) FROM gpu_samples "
                              "GROUP BY host"))
    assert stages == {"sim-node0": [0, 1, 2, 3], "sim-node1": [4, 5, 6, 7]}
    assert gpus == {"sim-node0": [0, 1, 2, 3], "sim-node1": [0, 1, 2, 3]}
    markdown = (run.report_dir / "report.md").read_text()
    assert "| sim-node1 | 3 | 7 |" in markdown
