"""`gputrace demo` (the README's quick block, as written, and the full demo): the motivating
deployment on its calibrated cost, bursts of 1,024-token prompts; the defaults and gputrace's
advice applied as real processes (time scaled), K = 64 where it was measured on the simulator's own
clock; their reports and the comparisons ([diagnosis] Must show 4, [advisor] Must show 1, [prefill]
Must show 7)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import readme_blocks, run_readme_block

from gputrace.demo import FIRST_TRY, SCENARIO, DemoPlan, run_one
from gputrace.sim.calibration import CONFLICTING, TOLERANCE
from gputrace.store import Store


def _phases(doc: dict) -> dict[str, float]:  # type: ignore[type-arg]
    return {p["label"]: p["throughput_tok_s"] for p in doc["phases"]}


@pytest.mark.slow
def test_quick_demo_applies_its_own_advice(tmp_path: Path) -> None:
    """The README's quick-demo block, run as written: it exits 0; the defaults' report carries
    the advice; the model's replay of the defaults is within 5 % of every measured phase; the
    second run applies exactly the advised settings (as its log's configuration says), loses no
    phase beyond 7 % and gains at least 5 % at one, measured; or the advice is to keep the
    settings and the demo says why. K = 64 runs with K 64; the table shows measured beside
    predicted."""
    block = next(b for b in readme_blocks() if "gputrace demo --quick" in b)
    out = tmp_path / re.search(r"gputrace demo --quick --out (\S+)", block)[1]  # type: ignore[index]
    returncode, output = run_readme_block(block, tmp_path, timeout_s=600)
    assert returncode == 0, f"the README's demo block failed:\n{block}\n--- output ---\n{output[-3000:]}"
    defaults = json.loads((out / "defaults" / "report" / "findings.json").read_text())
    advice = defaults["advice"]
    for p in advice["phases"]:
        assert abs(p["unchanged_tok_s"] / p["measured_tok_s"] - 1) <= 0.05, p
    k64 = json.loads((out / "k64" / "report" / "findings.json").read_text())
    assert k64["summary"]["engine"]["pp_max_micro_batch_size"] == FIRST_TRY["pp_max_micro_batch_size"]
    stdout = output.replace("\n", " ")
    assert "predicted" in stdout and "model as run" in stdout
    assert f"gputrace's advice: {advice['sentence'][:40]}" in stdout
    if not advice["changes"]:
        assert advice["reason"] and "Keep the current settings" in stdout
        assert not (out / "advised").exists()
    else:
        advised = json.loads((out / "advised" / "report" / "findings.json").read_text())
        engine = advised["summary"]["engine"]
        for c in advice["changes"]:
            if c["knob"] in engine:
                assert engine[c["knob"]] == c["value"], (c, engine)
        before, after = _phases(defaults), _phases(advised)
        gains = {k: after[k] / before[k] - 1 for k in before if before[k]}
        assert min(gains.values()) >= -0.07, gains
        assert max(gains.values()) >= 0.05, gains
        assert "applied, measured vs defaults" in stdout
        assert any((out / "compare-defaults-advised").iterdir())
    runs = ["defaults", "k64"] + (["advised"] if advice["changes"] else [])
    for run in runs:
        doc = json.loads((out / run / "report" / "findings.json").read_text())
        # every engine logged every decode step, as the README asks: no sampling caveat in a report
        assert doc["summary"]["engine"]["decode_log_interval"] == 1, run
        assert not any("decode lines are logged every" in note for note in doc["notes"]), run
        # a client that leaves mid-stream (the load's last level ending) is no error in the server's
        # log (the live runs: K = 64 runs on the simulator's own clock)
        if run != "k64":
            assert "Traceback" not in (out / "work" / run / "sim-0.out").read_text(), run
    for run in ("defaults", "k64"):
        assert (out / run / "report" / "report.html").stat().st_size > 10_000
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


# serial: the defaults and the advice run live, the simulated engine at 8x the wall clock (demo.SPEED;
# test_a_burst_sent_over_ms_runs_as_the_deployments pins why 8x); a real-time chain on shared cores
@pytest.mark.slow
@pytest.mark.serial
def test_the_demo_tells_the_motivating_story(tmp_path: Path) -> None:
    """[prefill] Must show 7: `gputrace demo` (what `make demo` runs) shows each motivating figure
    beside the demo's, each within 15 % (of the two C=32 K=64 figures that cannot both hold, the
    better); its first line is the cause in the engine's words (one micro-batch of 8, the prefill
    budget admitting 8 prompts a turn, 4 micro-batches for 8 stages); the model fitted to the
    defaults predicts K = 64 changes nothing at C=32 (within 5 %, as 248 -> 250.9 measured); and the
    advice, applied, gains measured at C=32 and loses no phase beyond 7 %."""
    out = tmp_path / "demo-out"
    done = subprocess.run([sys.executable, "-m", "gputrace", "demo", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    print(done.stdout)
    summary = json.loads((out / "demo-summary.json").read_text())
    rows = {r["figure"]: r for r in summary["figures"]}
    assert {"C=1 K=8 512 tok", "C=32 K=8 512 tok", "C=48 K=64 4096 tok", "C=64 K=64 2048 tok",
            *CONFLICTING} <= set(rows)
    for label, r in rows.items():
        if label not in CONFLICTING:
            assert abs(r["ratio"] - 1) <= TOLERANCE, r
    assert min(abs(rows[label]["ratio"] - 1) for label in CONFLICTING) <= TOLERANCE
    first_line = done.stdout.splitlines()[0]
    assert first_line.startswith("Cause: `#running-req: 8` is one micro-batch"), first_line
    assert "admits 8 prompts per turn" in first_line and "4 micro-batches for 8 stages" in first_line
    assert "[prefill_burst, C=32]" in first_line
    before, k64 = summary["defaults_tok_s"]["C=32"], summary["first_try_predicted_tok_s"]["C=32"]
    assert abs(k64 / before - 1) <= 0.05, (before, k64)
    assert "--pp-max-micro-batch-size 64 (what the engineer tried first)" in done.stdout
    measured = summary["advice_measured_tok_s"]
    assert summary["advice"].startswith("Set "), summary["advice"]
    assert measured["C=32"] >= 1.05 * before, (measured, before)
    assert all(measured[k] >= 0.93 * v for k, v in summary["defaults_tok_s"].items()), measured
    assert summary["advice_predicted_tok_s"]["C=32"] > before
    assert "applied, measured vs defaults: " in done.stdout and "time scaled" in done.stdout
    # the advice's figures in the deployment's time, as the measured ones beside them: its sentence's
    # "C=32 240 -> 440 tok/s" is the defaults' measured figure and the prediction the summary holds
    stated = re.search(r"C=32 (\d+) -> (\d+) tok/s", summary["advice"])
    assert stated is not None, summary["advice"]
    assert float(stated[1]) == pytest.approx(before, rel=0.12), (stated[0], before)  # 4x would be 300 %
    assert abs(float(stated[2]) - summary["advice_predicted_tok_s"]["C=32"]) <= 1, stated[0]
    assert stated[0] in done.stdout
    # and the advice, applied, measured inside the band it stated where it stated a gain (C=32); at
    # the others it holds (no loss beyond 7 %, above: a lone request's level moved 19 % between
    # runs at a load of 50 on this machine's two cores)
    phases = {p["phase"]: p for p in summary["advice_phases"]}
    assert set(phases) == set(summary["defaults_tok_s"]), phases
    for label, p in phases.items():
        assert p["measured_before_tok_s"] == pytest.approx(summary["defaults_tok_s"][label], rel=0.01)
        assert p["measured_after_tok_s"] == pytest.approx(measured[label])
        assert p["band_ratio"] <= 0.25, p  # wider is "cannot predict" (issue 47, Build)
    assert phases["C=32"]["stated"], phases
    # The applied advice measured inside its band since the demo's client streams (the requests'
    # time to first token prices a prompt token: +69 % +-17 % predicted, +58 % measured, where the
    # dense ratio gave +83 % +-13 %, outside it in every run at 8x). A miss is reported as the
    # known defect it was (issue 47, Must-show 7), with its figures, not as a pass.
    missed = [p for p in phases.values() if p["stated"] and not p["within_band"]]
    if missed:
        pytest.xfail(f"the advice measured outside its stated band (issue 47, Must-show 7): {missed}")


@pytest.mark.parametrize("wall_ms", [1.0, 2.0, 12.0])
def test_a_burst_sent_over_ms_runs_as_the_deployments(tmp_path: Path, wall_ms: float) -> None:
    """The live demo's C=32 burst reaches the server over 1-2 ms of wall time on this machine
    (more under load): at demo.SPEED that is the engine's time over which it lands, and there the
    burst runs as the deployment's did (turns of 1, 7, 8, 8, 8; 4 or 5 micro-batches in flight),
    the first finding prefill_burst. (At 4x, 1 ms landed inside the 1-5 ms of engine time where
    stage 0's 50 us turns give the first arrivals a turn each: six micro-batches in flight, and
    the live run named pipeline_underfilled in 1 of 3 runs, CI's included.)"""
    from gputrace.analyse import analyse_run
    from gputrace.demo import LOGGED_AS_ADVISED, SPEED
    from gputrace.sim.outputs import write_store
    from gputrace.sim.params import KIMI_K26_PCIE_COST, scenario_params
    from gputrace.sim.virtual import run_params

    spread_s = wall_ms / 1e3 * SPEED
    params = scenario_params(SCENARIO, {
        **KIMI_K26_PCIE_COST, **LOGGED_AS_ADVISED, "client_mode": "burst", "concurrency": (32,),
        "max_tokens": 512, "phase_s": 600.0, "drain_s": 0.0, "seed": 0,
        "burst_offsets_s": tuple(i * spread_s / 31 for i in range(32))})
    run_dir = write_store(run_params(params, "burst"), tmp_path / "burst", "burst")
    with Store.open(run_dir, read_only=True) as store:
        analysis = analyse_run(store, effects=False)
    phase = analysis.metrics[0]
    # 4 in flight (turns of 1, 7, 8, 8, 8), 5 where two land alone first (1, 1, 7, 8, 8, 7: 8 ms)
    assert phase.microbatches_in_flight is not None and phase.microbatches_in_flight < 5.5, \
        phase.microbatches_in_flight
    assert analysis.findings[0].cause.value == "prefill_burst", [f.key for f in analysis.findings]
