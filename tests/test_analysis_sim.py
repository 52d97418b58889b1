"""The diagnosis held to the simulator's ground truth: every preset, several seeds; the motivating
micro-batch cap case and its fix; the same diagnosis from imported files alone."""

from __future__ import annotations

import dataclasses
import datetime as dt
from pathlib import Path

import numpy as np
import pytest

from gputrace.analyse import analyse_run
from gputrace.analysis.compare import compare_analyses
from gputrace.analysis.result import Analysis
from gputrace.imports.engine_log import ingest_log
from gputrace.imports.jsonl import write_jsonl
from gputrace.imports.nvidia_smi import import_nvidia_smi_csv
from gputrace.imports.request_files import import_requests_jsonl
from gputrace.report.document import build_document
from gputrace.sim.outputs import request_records, sample_columns, write_gpu_csv, write_log, write_store
from gputrace.sim.params import SCENARIOS
from gputrace.sim.truth import fix_for, scenario_fixes
from gputrace.sim.virtual import SimResult, run_scenario
from gputrace.store import Store
from gputrace.vocabulary import Change

SEEDS = (0, 1, 2)
_CACHE: dict[tuple[str, int], tuple[Analysis, dict]] = {}  # type: ignore[type-arg]
_STORES: dict[tuple[str, int], tuple[Path, Path]] = {}


@pytest.fixture(scope="module")
def sim_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sim")


def with_nccl_spin(result: SimResult) -> SimResult:
    """The same run with NCCL's spinning receive: only its GPU samples differ (the engine does not
    read the setting; test_nccl_spin_changes_only_the_gpu_samples holds this)."""
    return dataclasses.replace(result, params=dataclasses.replace(result.params, nccl_spin=True))


def simulated_stores(sim_dir: Path, scenario: str, seed: int) -> tuple[Path, Path]:
    """The run's store, and the same run's with NCCL's spinning receive: simulated once, the two
    written together (each simulated run kept would hold ~100 MB of trace until its spin test)."""
    key = (scenario, seed)
    if key not in _STORES:
        result = run_scenario(scenario, seed)
        _STORES[key] = (write_store(result, sim_dir / f"{scenario}-{seed}"),
                        write_store(with_nccl_spin(result), sim_dir / f"{scenario}-{seed}-spin"))
    return _STORES[key]


def _analysed_store(path: Path) -> tuple[Analysis, dict]:  # type: ignore[type-arg]
    with Store.open(path, read_only=True) as store:
        return analyse_run(store, effects=False), dict(store.meta.extra["ground_truth"])  # type: ignore[arg-type]


def analysed(sim_dir: Path, scenario: str, seed: int) -> tuple[Analysis, dict]:  # type: ignore[type-arg]
    """The analysis of a simulated run and its ground truth (each run simulated once per module)."""
    key = (scenario, seed)
    if key not in _CACHE:
        _CACHE[key] = _analysed_store(simulated_stores(sim_dir, scenario, seed)[0])
    return _CACHE[key]


def test_nccl_spin_changes_only_the_gpu_samples() -> None:
    """What with_nccl_spin rests on: a run simulated with the spin has the same engine trace, log
    and ground truth as without, and the GPU samples of the run without it, with the spin set."""
    plain = run_scenario("bunched", 1, {"phase_s": 6.0})
    spun = run_scenario("bunched", 1, {"phase_s": 6.0, "nccl_spin": True})
    assert spun.log_lines == plain.log_lines and spun.ground_truth == plain.ground_truth
    assert spun.engine.trace.iv_end == plain.engine.trace.iv_end
    derived, real = sample_columns(with_nccl_spin(plain)), sample_columns(spun)
    assert derived.keys() == real.keys()
    for column, values in real.items():
        assert np.array_equal(np.asarray(derived[column]), np.asarray(values)), column
    assert not np.array_equal(np.asarray(sample_columns(plain)["utilization_ratio"]),
                              np.asarray(real["utilization_ratio"]))


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_findings_and_bubbles_match_ground_truth(sim_dir: Path, scenario: str, seed: int) -> None:
    """Per phase the findings name exactly the true causes, and every stage's bubble fraction is
    within 2 percentage points of the truth."""
    a, truth = analysed(sim_dir, scenario, seed)
    assert [p.label for p in a.metrics] == [p["label"] for p in truth["phases"]]
    found: dict[str, set[str]] = {}
    for f in a.findings:
        found.setdefault(f.phase, set()).add(f.cause)
    run_wide = found.pop("*", set())
    for pm, gt in zip(a.metrics, truth["phases"], strict=True):
        want = set(gt["causes"]) - {"log_sampling_aliased"}
        assert found.get(pm.label, set()) == want, (pm.label, gt)
        for stage, gs in zip(pm.stages, gt["stages"], strict=True):
            assert stage.bubble_fraction is not None
            assert abs(stage.bubble_fraction - gs["bubble_fraction"]) <= 0.02, (pm.label, stage.pp_rank)
    aliased = any("log_sampling_aliased" in p["causes"] for p in truth["phases"])
    assert run_wide == ({"log_sampling_aliased"} if aliased else set())
    assert set(truth["causes"]) <= {f.cause for f in a.findings}


def test_microbatch_cap_is_the_first_finding(sim_dir: Path) -> None:
    """microbatch-cap (K = 2 set below a pool of 64): first finding microbatch_cap with K = 2 from
    the flag, and K = ceil(load / 8 slots) to set: 4 at C=32, 8 at C=64."""
    a, _ = analysed(sim_dir, "microbatch-cap", 0)
    first = a.findings[0]
    assert first.cause == "microbatch_cap"
    ev = first.evidence
    assert ev["K"] == 2 and ev["K_from"] == "--pp-max-micro-batch-size" and ev["pp_size"] == 8
    assert first.recommendation.startswith("--pp-max-micro-batch-size ")
    caps = {f.phase: f.change.value for f in a.findings if f.cause == "microbatch_cap" and f.change}
    assert caps == {"C=32": 4, "C=64": 8}


def test_fix_removes_the_cap_and_compare_shows_the_gain(sim_dir: Path) -> None:
    """microbatch-fixed (K back at 8) has no cap finding; compare shows the throughput gain at C=32
    and C=64."""
    capped, _ = analysed(sim_dir, "microbatch-cap", 0)
    fixed, truth = analysed(sim_dir, "microbatch-fixed", 0)
    assert all(f.cause != "microbatch_cap" for f in fixed.findings)
    doc = compare_analyses(capped, fixed)
    by_label = {p["label"]: p for p in doc["phases"]}
    true_b = {p["label"]: p["throughput_tok_s"] for p in truth["phases"]}
    for label in ("C=32", "C=64"):
        row = by_label[label]
        assert row["throughput_gain"] > 1.2, row
        assert "microbatch_cap" in row["findings_resolved"]
        assert abs(row["throughput_tok_s_b"] - true_b[label]) / true_b[label] < 0.05


def test_diagnosis_from_imported_files_alone(tmp_path: Path) -> None:
    """An SGLang log, an nvidia-smi CSV and a requests JSONL, imported into an empty store (no
    topology, no clock probes, no receive times, no markers), give the same diagnosis."""
    result = run_scenario("microbatch-cap", 2)
    write_log(result, tmp_path / "server.log")
    write_gpu_csv(result, tmp_path / "gpu.csv", sample_columns(result))
    write_jsonl(tmp_path / "requests.jsonl", request_records(result))
    truth = result.ground_truth
    with Store.create(tmp_path / "imported") as store:
        ingest_log(store, tmp_path / "server.log", host="gpu-box", engine=result.params.engine)
        import_nvidia_smi_csv(store, tmp_path / "gpu.csv", host="gpu-box")
        import_requests_jsonl(store, tmp_path / "requests.jsonl", host="client")
        a = analyse_run(store, effects=False)
    s = a.summary()
    assert s["mapping_source"] == "engine config + SGLang formula" and s["pp_size"] == 8
    assert s["log_placement"].startswith("spread by order") and s["phase_source"] == "request labels"
    assert a.findings[0].cause == "microbatch_cap" and a.findings[0].evidence["K"] == 2
    for pm, gt in zip(a.metrics, truth["phases"], strict=True):
        assert pm.label == gt["label"]
        assert {f.cause for f in a.findings if f.phase == pm.label} == set(gt["causes"])
        for stage, gs in zip(pm.stages, gt["stages"], strict=True):
            assert abs((stage.bubble_fraction or 0) - gs["bubble_fraction"]) <= 0.02


def test_log_sampling_aliased_run_wide(tmp_path: Path) -> None:
    """--decode-log-interval 40 with 8 slots: one run-wide log_sampling_aliased finding (phase
    "*") recommending --decode-log-interval 1; the phase findings and bubbles still hold."""
    result = run_scenario("healthy", 0, {"decode_log_interval": 40})
    with Store.open(write_store(result, tmp_path / "run"), read_only=True) as store:
        a = analyse_run(store, effects=False)
    aliased = [f for f in a.findings if f.cause == "log_sampling_aliased"]
    assert len(aliased) == 1 and aliased[0].phase == "*"
    assert aliased[0].evidence["decode_log_interval"] == 40 and aliased[0].evidence["microbatch_slots"] == 8
    assert "--decode-log-interval 1" in aliased[0].recommendation
    for pm, gt in zip(a.metrics, result.ground_truth["phases"], strict=True):
        assert "log_sampling_aliased" in gt["causes"]
        want = set(gt["causes"]) - {"log_sampling_aliased"}
        assert {f.cause for f in a.findings if f.phase == pm.label} == want
        for stage, gs in zip(pm.stages, gt["stages"], strict=True):
            assert abs((stage.bubble_fraction or 0) - gs["bubble_fraction"]) <= 0.02


@pytest.mark.parametrize(("interval", "logged"), [(12, 2), (4, 2), (2, 4), (3, None), (9, None)])
def test_log_sampling_aliased_where_the_interval_shares_a_factor(tmp_path: Path, interval: int,
                                                                 logged: int | None) -> None:
    """[diagnosis] Build: aliasing needs a factor in common between --decode-log-interval and the
    micro-batches in flight, not a multiple of them: with 8 in flight, 12 (12 % 8 = 4) leaves each
    stage logging 2 of the 8, 2 leaves 4; 3 and 9 are coprime with 8 and every micro-batch is logged.
    The simulator's truth and the diagnosis say the same."""
    result = run_scenario("healthy", 0, {"decode_log_interval": interval, "phase_s": 40.0})
    with Store.open(write_store(result, tmp_path / "run"), read_only=True) as store:
        a = analyse_run(store, effects=False)
    truth_aliased = ["log_sampling_aliased" in p["causes"] for p in result.ground_truth["phases"]]
    aliased = [f for f in a.findings if f.cause == "log_sampling_aliased"]
    if logged is None:
        assert not aliased and not any(truth_aliased), aliased
        return
    assert all(truth_aliased) and len(aliased) == 1 and aliased[0].phase == "*"
    (phase,) = aliased[0].evidence["aliased_phases"].values()
    assert phase == {"microbatches_in_flight": 8, "common_factor": 8 // logged, "microbatches_logged": logged}
    assert aliased[0].change == Change("decode_log_interval", "--decode-log-interval", 1)


def test_below_one_request_per_stage_the_bubble_is_not_the_bottleneck(sim_dir: Path) -> None:
    """[diagnosis] Build: at C=1 on 8 stages no setting fills the pipeline, and the finding says the
    bubble is not the bottleneck (and asks for load or fewer stages); at C=8 and C=32 a smaller K
    spreads the load, so there the bubble is named as what to fix."""
    a, truth = analysed(sim_dir, "motivating", 0)
    under = {f.phase: f for f in a.findings if f.cause == "pipeline_underfilled"}
    assert set(under) == {"C=1", "C=8", "C=32"}
    light = under["C=1"]
    assert light.evidence["reason"] == "light_load" and light.evidence["bubble_is_the_bottleneck"] is False
    assert "the bubble is not the bottleneck at this load" in light.summary
    assert light.change == Change("concurrency", "concurrency", 8)
    for label in ("C=8", "C=32"):
        assert under[label].evidence["reason"] == "bunched"
        assert "not the bottleneck" not in under[label].summary + under[label].recommendation
    # the truth's C=1 bubble is large (7 of 8 stages wait): it is named, just not as the bound
    assert next(p for p in truth["phases"] if p["label"] == "C=1")["stages"][1]["bubble_fraction"] > 0.5


def test_phases_detected_from_the_engine_log_alone(tmp_path: Path) -> None:
    """With no requests and no markers, the sweep's levels are found from the engine's running +
    queued requests, and the cap is still diagnosed at 32 and 64."""
    result = run_scenario("microbatch-cap", 0)
    with Store.open(write_store(result, tmp_path / "run")) as store:
        store.sql("DELETE FROM requests")
        store.sql("DELETE FROM markers")
        a = analyse_run(store, effects=False)
    assert [p.target_concurrency for p in a.phases] == [1, 8, 32, 64]
    assert a.phases[0].source == "detected from engine running + queued requests"
    assert a.summary()["work_source"] == "engine running + queued requests (log)"
    assert {f.phase for f in a.findings if f.cause == "microbatch_cap"} == {"load=32", "load=64"}
    assert a.findings[0].cause == "microbatch_cap"


def analysed_spun(sim_dir: Path, scenario: str, seed: int) -> tuple[Analysis, dict]:  # type: ignore[type-arg]
    """The same as analysed, with NCCL's spinning receive on (each run simulated once per module)."""
    key = (f"{scenario}+spin", seed)
    if key not in _CACHE:
        _CACHE[key] = _analysed_store(simulated_stores(sim_dir, scenario, seed)[1])
    return _CACHE[key]


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_with_nccl_spin_the_bubbles_still_match(sim_dir: Path, scenario: str, seed: int) -> None:
    """NCCL's spinning receive makes utilization.gpu read ~100 % on waiting ranks; the busy figure
    comes from SM activity, so the causes and every bubble (within 2 points) still match the truth."""
    a, truth = analysed_spun(sim_dir, scenario, seed)
    for pm, gt in zip(a.metrics, truth["phases"], strict=True):
        want = set(gt["causes"]) - {"log_sampling_aliased"}
        assert {f.cause for f in a.findings if f.phase == pm.label} == want, (pm.label, gt["causes"])
        for stage, gs in zip(pm.stages, gt["stages"], strict=True):
            assert stage.busy_signal == "SM activity (GPM)"
            assert abs((stage.bubble_fraction or 0) - gs["bubble_fraction"]) <= 0.02, (pm.label, stage)


def test_the_report_says_which_signal_and_warns_about_the_spin(sim_dir: Path) -> None:
    """[diagnosis] Must show 3: with spin on, the note names utilization.gpu against SM activity and
    NCCL's waiting kernels; each stage's row says its busy figure is SM activity."""
    result = run_scenario("bunched", 0, {"nccl_spin": True, "phase_s": 40.0})
    with Store.open(write_store(result, sim_dir / "bunched-spin-report"), read_only=True) as store:
        spun = analyse_run(store, effects=False)
    note = next(n for n in spun.notes if "utilization.gpu" in n)
    assert "NCCL's waiting kernels" in note and "SM activity" in note and "100%" in note
    doc = build_document(spun)
    assert {row["busy_signal"] for row in doc["table"]} == {"SM activity (GPM)"}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("scenario", sorted(s for s in SCENARIOS if SCENARIOS[s].causes))
@pytest.mark.parametrize("spin", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["no-spin", "nccl-spin"])
def test_the_recommended_change_is_the_ground_truths_fix(sim_dir: Path, scenario: str, seed: int,
                                                         spin: bool) -> None:
    """[diagnosis] Must show 2: for every cause the truth names, the finding's change has the fix's
    knob, and where the fix is one number, a value within 25 % of it; the same with NCCL's spinning
    receive filling utilization.gpu on the waiting ranks."""
    a, truth = (analysed_spun if spin else analysed)(sim_dir, scenario, seed)
    params = run_scenario(scenario, seed, {"phase_s": 1.0}).params
    for gt in truth["phases"]:
        for cause in gt["causes"]:
            fix = fix_for(params, cause, gt)
            found = [f for f in a.findings if f.cause == cause and f.phase in (gt["label"], "*")]
            assert found, (gt["label"], cause)
            if fix is None:  # no setting removes it (a light load: the finding asks for more load)
                continue
            change = found[0].change
            assert change is not None and change.flag == fix["knob"], (gt["label"], cause, change, fix)
            if isinstance(fix["value"], int):
                assert change.value is not None
                assert abs(change.value - fix["value"]) <= 0.25 * fix["value"], (gt["label"], fix)


@pytest.mark.slow
@pytest.mark.parametrize("scenario", sorted(s for s in SCENARIOS if SCENARIOS[s].causes))
def test_each_scenarios_fix_removes_its_cause_at_the_stated_throughput(scenario: str) -> None:
    """[sim] Must show 3: each fix the ground truth states, applied in a fresh run, leaves the cause
    gone in its phases and gives the throughput the truth states for it (deterministic: same seed)."""
    result = run_scenario(scenario, 0, log=False)  # only its truth is read
    fixes = scenario_fixes(result)
    assert fixes or all(fix_for(result.params, c, ph) is None for ph in result.ground_truth["phases"]
                        for c in ph["causes"])
    for fix in fixes:
        again = run_scenario(scenario, 0, {k: tuple(v) if isinstance(v, list) else v
                                           for k, v in fix["params"].items()}, log=False)
        after = {ph["label"]: ph for ph in again.ground_truth["phases"]}
        for label, stated in fix["phases"].items():
            assert not set(fix["causes"]) & set(after[label]["causes"]), (label, fix)
            assert after[label]["throughput_tok_s"] == stated["fixed_throughput_tok_s"]
            if fix["knob"] != "--decode-log-interval":  # a measurement fix changes no throughput
                assert stated["fixed_throughput_tok_s"] > stated["throughput_tok_s"], (label, fix)


def analysed_from_smi_csv(tmp_path: Path, scenario: str, seed: int) -> tuple[Analysis, dict]:  # type: ignore[type-arg]
    """A run with NCCL's spinning receive, imported as an nvidia-smi CSV (utilization and power, no
    SM activity), its log and its requests: what a user without GPM or DCGM profiling has."""
    result = run_scenario(scenario, seed, {"nccl_spin": True})
    write_log(result, tmp_path / "server.log")
    write_gpu_csv(result, tmp_path / "gpu.csv", sample_columns(result))
    write_jsonl(tmp_path / "requests.jsonl", request_records(result))
    # vLLM stamps MM-DD: the year given as `gputrace import --date` gives it
    day = dt.datetime.fromtimestamp(result.ground_truth["phases"][0]["start_ns"] / 1e9, dt.UTC).date()
    with Store.create(tmp_path / "imported") as store:
        ingest_log(store, tmp_path / "server.log", host="gpu-box", engine=result.params.engine, date=day)
        import_nvidia_smi_csv(store, tmp_path / "gpu.csv", host="gpu-box")
        import_requests_jsonl(store, tmp_path / "requests.jsonl", host="client")
        return analyse_run(store, effects=False), dict(result.ground_truth)


# bunched: SGLang's prefill budget cuts the 32nd prompt, which joins the next slot, so the 32 run as
# micro-batches of 31 and 1; the log's schedule counts each as a stage's step whatever its size, and
# its bubble (a lower bound) reads 0.73-0.75 against 0.83-0.84 at seeds 0 and 2 (seed 1 keeps within
# 5). Weighing each step by its requests (windows of consecutive decode lines, mean / largest) reads
# 0.846 / 0.874 / 0.836 against 0.834 / 0.875 / 0.835, but puts microbatch-cap's C=8 (K = 2,
# micro-batches of 1 and 2, both under the memory floor, so costing alike) at 0.50 against 0.40: the
# log gives a step's requests, not where the floor ends, so the weight needs the fitted step cost.
# Strict at seeds 0 and 2 (a pass there is news); seed 1 passes as it is.
UNEVEN_MICROBATCHES = ("the schedule from the log weighs a micro-batch of 1 as one of 31: bubble "
                       "0.73-0.75 against 0.83-0.84 at seeds 0 and 2 (a lower bound, 9-11 points under); "
                       "weighing steps by their requests fixes it but breaks microbatch-cap C=8 "
                       "(0.50 against 0.40: steps under the memory floor cost alike)")


@pytest.mark.parametrize(("scenario", "seed"), [
    *[pytest.param("bunched", seed, marks=pytest.mark.xfail(strict=True, reason=UNEVEN_MICROBATCHES))
      if seed != 1 else ("bunched", seed) for seed in SEEDS],
    *[pytest.param(name, seed, marks=pytest.mark.slow)
      for name in ("microbatch-cap", "stage-imbalance", "vllm-admission") for seed in SEEDS]])
def test_without_sm_activity_a_spinning_stage_is_not_taken_as_busy(tmp_path: Path, scenario: str,
                                                                   seed: int) -> None:
    """[busy] Must show 1: NCCL spin with utilization and power only: where utilization.gpu reads
    more than the log's schedule allows, the busy figure is the schedule's (shared out by power),
    every stage's bubble within 5 points of the true compute-idle share, and the report says which
    signal it used and why utilization was not taken."""
    a, truth = analysed_from_smi_csv(tmp_path, scenario, seed)
    distrusted = False
    for pm, gt in zip(a.metrics, truth["phases"], strict=True):
        for stage, gs in zip(pm.stages, gt["stages"], strict=True):
            assert stage.bubble_fraction is not None
            assert abs(stage.bubble_fraction - gs["bubble_fraction"]) <= 0.05, (pm.label, stage, gs)
            if stage.busy_signal == "schedule from the log":
                distrusted = True
                assert stage.utilization_mean is not None and stage.utilization_mean > 0.95
                assert "NCCL's waiting kernels count in utilization.gpu" in (stage.busy_signal_reason or "")
                # the schedule bounds busy from above: a stage also waits between forwards
                assert (stage.busy_signal_reason or "").endswith("so this bubble is a lower bound")
    assert distrusted
    notes = "\n".join(a.notes)
    assert "take their busy figure from the schedule from the log" in notes and "W idle" in notes
    assert "in this order: the engine's device timer > SM activity" in notes


def test_the_engines_device_timer_ranks_first(tmp_path: Path) -> None:
    """[busy] The ranking's top: with SGLang's device timer on (forward_execution_seconds_total in
    its /metrics), each stage's busy figure is the timer's, above SM activity, and with NCCL's spin
    filling utilization.gpu the bubbles still match the truth within 2 points."""
    result = run_scenario("bunched", 0, {"nccl_spin": True, "device_timer": True, "phase_s": 40.0})
    with Store.open(write_store(result, tmp_path / "run"), read_only=True) as store:
        a = analyse_run(store, effects=False)
    for pm, gt in zip(a.metrics, result.ground_truth["phases"], strict=True):
        for stage, gs in zip(pm.stages, gt["stages"], strict=True):
            assert stage.busy_signal == "the engine's device timer (forward_execution_seconds)"
            assert abs((stage.bubble_fraction or 0) - gs["bubble_fraction"]) <= 0.02, (pm.label, stage)
