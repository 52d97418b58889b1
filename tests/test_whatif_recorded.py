"""[whatif] on the recorded real engines (tests/data/engines/: SGLang 0.5.23 and vLLM 0.32.0 at
PP=2 on this machine's CPU, two settings each, the same load C = 1, 4, 16): the simulator fitted to
one setting's run predicts the other setting's run, which the engine really ran. These runs have
no GPU samples, so the fit is the replay's (scale, and token part against flat part).

The target is the issue's: predicted throughput within 25 % of measured at every level, either
way round. vLLM meets it; SGLang on this CPU does not: its two settings schedule the same (K is
above the request pool in both) and still measured 25-50 % apart at C=4 and C=16, more than any
prediction can be held to."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from engine_fixtures import fixture_dir
from helpers import analyse

from gputrace.analyse import analyse_run
from gputrace.store import Store
from gputrace.whatif.fit import fit_model
from gputrace.whatif.outcome import measured_outcomes, relative_error
from gputrace.whatif.predict import check_changes, predict

TARGET = 0.25
# (engine, fitted setting, predicted setting, the change from the first to the second)
PAIRS = [
    ("vllm", "default", "seqs4", {"max_num_seqs": 4}),
    ("vllm", "seqs4", "default", {"max_num_seqs": 8}),
    ("sglang", "default", "k16", {"pp_max_micro_batch_size": 16}),
    ("sglang", "k16", "default", {"pp_max_micro_batch_size": 32}),
]
SGLANG_NOISE = ("[whatif] MS2: SGLang on this CPU measured its two settings (the same schedule) "
                "25-50 % apart at C=4 and C=16 (90 vs 68, 61 vs 78 tok/s): the run-to-run spread "
                "exceeds the 25 % target")

_IMPORTED: dict[tuple[str, str], Path] = {}


def _imported(tmp_factory: pytest.TempPathFactory, engine: str, name: str) -> Path:
    key = (engine, name)
    if key not in _IMPORTED:
        where = fixture_dir(engine, name)
        run = tmp_factory.mktemp(f"{engine}-{name}") / "run"
        date = str(json.loads((where / "args.json").read_text())["recorded_utc"])[:10]
        out = subprocess.run(
            [sys.executable, "-m", "gputrace", "import", "--run", str(run), "--host", "engine-host",
             f"--{engine}-log", str(where / "engine.log"), "--requests", str(where / "requests.jsonl"),
             "--date", date, "--no-progress"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        _IMPORTED[key] = run
    return _IMPORTED[key]



def _errors(tmp_factory: pytest.TempPathFactory, engine: str, fitted: str, other: str,
            change: dict[str, int]) -> dict[str, float]:
    """Per level: predicted against the other setting's measured throughput, less one."""
    base = analyse(_imported(tmp_factory, engine, fitted))
    model = fit_model(base)
    named = check_changes(base.run.engine, base.run.pp_size, change)
    measured = {m.label: m for m in measured_outcomes(analyse(_imported(tmp_factory, engine, other)))}
    out = {}
    for row in predict(model, named):
        e = relative_error(row.predicted.throughput_tok_s, measured[row.label].throughput_tok_s)
        assert e is not None, row
        out[row.label] = e
    print(f"\n{engine} {fitted} -> {other} {change}: " +
          ", ".join(f"{k} {v:+.0%}" for k, v in out.items()) + f" (band ±{model.uncertainty_ratio:.0%})")
    return out


@pytest.mark.parametrize(("engine", "fitted", "other", "change"), [
    pytest.param(*p, id=f"{p[0]}-{p[1]}-to-{p[2]}",
                 marks=[pytest.mark.xfail(strict=True, reason=SGLANG_NOISE)] if p[0] == "sglang" else [])
    for p in PAIRS])
def test_the_fit_on_one_setting_predicts_the_other_within_25_percent(
        tmp_path_factory: pytest.TempPathFactory, engine: str, fitted: str, other: str,
        change: dict[str, int]) -> None:
    errors = _errors(tmp_path_factory, engine, fitted, other, change)
    assert set(errors) == {"C=1", "C=4", "C=16"}
    assert all(abs(e) <= TARGET for e in errors.values()), errors


def test_the_fit_without_gpu_samples_says_how_it_was_made(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A CPU engine's run has no busy figures: the model says its shape came from replays, it
    replays the captured vLLM run within the target at every level, and its band is the replay's
    RMS residual."""
    model = fit_model(analyse(_imported(tmp_path_factory, "vllm", "default")))
    assert any("fitted by replaying the phases" in n for n in model.notes), model.notes
    errors = [row.throughput_error for row in model.quality_rows()]
    assert len(errors) == 3 and all(abs(e) <= TARGET for e in errors), errors
    rms = sum(e * e for e in errors) / len(errors)
    assert model.uncertainty_ratio == pytest.approx(max(rms ** 0.5, 0.03))


def test_whatif_takes_vllm_names(tmp_path_factory: pytest.TempPathFactory) -> None:
    """`--set max_num_seqs=4` is vLLM's name for the admission limit: accepted, and reported
    in vLLM's words (the simulator's name for it is SGLang's)."""
    run = _imported(tmp_path_factory, "vllm", "default")
    out = subprocess.run([sys.executable, "-m", "gputrace", "whatif", str(run), "--set", "max_num_seqs=4",
                          "--format", "json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout)
    assert list(doc["changes"]) == ["max_num_seqs"] and int(doc["changes"]["max_num_seqs"]) == 4
    bad = subprocess.run([sys.executable, "-m", "gputrace", "whatif", str(run), "--set", "max_num_seq=4"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "max_num_seqs" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_a_cost_or_gain_that_is_the_fits_offset_is_not_claimed(tmp_path_factory: pytest.TempPathFactory
                                                                ) -> None:
    """The recorded SGLang default run: the fit replayed C=4 at about 49 tok/s where 90 were
    measured. Raising the admission limit to 16 does not move C=4 (4 requests never reach it):
    the prediction there, calibrated (measured x model(change) / model(as run)), stays at the
    measurement, and no cost is claimed (it said 'costs C=4 90 -> 49 tok/s', the fit's offset);
    the model as run, corrected per phase, is within 5 % of every measured phase."""
    from gputrace.whatif.effects import with_predicted_effects

    analysis, model = with_predicted_effects(analyse(_imported(tmp_path_factory, "sglang", "default")))
    assert model is not None
    (finding,) = [f for f in analysis.findings if f.cause == "admission_bound"]
    effect = analysis.effects[finding.key]
    (c4,) = [o for o in effect.other_phases if o.phase == "C=4"]
    assert abs(c4.predicted_tok_s / c4.measured_tok_s - 1) < effect.band_ratio
    for m in model.measured:
        unchanged = model.unchanged_tok_s(m.label)
        assert m.throughput_tok_s and unchanged
        assert abs(unchanged / m.throughput_tok_s - 1) <= 0.05
    assert "costs" not in analysis.recommendation_of(finding)


def test_compare_of_the_recorded_vllm_settings_sets_predicted_beside_measured(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """`gputrace compare` of vLLM's default run and its --max-num-seqs 4 run (the real engine):
    the change is read from the two logs, the prediction is the what-if's (the same fit), and
    every level's prediction is within the target of what the engine measured."""
    a, b = _imported(tmp_path_factory, "vllm", "default"), _imported(tmp_path_factory, "vllm", "seqs4")
    out = subprocess.run([sys.executable, "-m", "gputrace", "compare", str(a), str(b), "--out", str(tmp_path),
                          "--format", "json,md"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    pam = json.loads((tmp_path / "compare.json").read_text())["predicted_against_measured"]
    assert pam["changes"] == {"max_running_requests": [8, 4]}
    errors = _errors(tmp_path_factory, "vllm", "default", "seqs4", {"max_num_seqs": 4})
    assert {r["label"]: r["error"] for r in pam["phases"]} == pytest.approx(errors, abs=1e-3)
    assert all(abs(r["error"]) <= TARGET for r in pam["phases"]), pam["phases"]
    assert "B changed max_running_requests 8 -> 4" in (tmp_path / "compare.md").read_text()


def test_a_cpu_engine_is_fitted_without_a_memory_floor(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Both recorded engines' logs state a CPU device (SGLang `device`, vLLM `device_config`): the
    fitted step is its flat part plus compute from the first token (no weight-read floor, so a
    batch of 16 costs more than one of 4 by the fitted slope), and the fit's note says so. A
    simulated GPU run keeps the floor."""
    from gputrace.sim.outputs import write_store
    from gputrace.sim.params import SimParams, make_params
    from gputrace.sim.virtual import run_scenario
    from gputrace.whatif.fit import PhaseWork, _design, runs_on_cpu, without_memory_floor

    for engine in ("sglang", "vllm"):
        analysis = analyse(_imported(tmp_path_factory, engine, "default"))
        assert runs_on_cpu(analysis.run.engine), analysis.run.engine.fields
        model = fit_model(analysis)
        p = model.params
        assert p.weight_read_s == 0.0 and p.launch_s > 0 and p.decode_token_s > 0, p
        assert any("CPU device" in n for n in model.notes), model.notes
    sim = tmp_path_factory.mktemp("gpu") / "run"
    write_store(run_scenario("microbatch-cap", 0), sim)
    with Store.open(sim, read_only=True) as store:
        assert not runs_on_cpu(analyse_run(store, effects=False).run.engine)
    # under the floor a step of 4 tokens costs what one of 1 does; without it, 3 slopes more
    gpu = make_params({"decode_token_s": 1e-4, "weight_read_s": 1e-2, "launch_s": 1e-3,
                       "context_token_s": 0.0})
    cpu = without_memory_floor(gpu)
    assert cpu.launch_s == pytest.approx(1.1e-2) and cpu.weight_read_s == 0.0

    def step_s(p: SimParams, tokens: int) -> float:
        work = PhaseWork("C", 0.0, 1.0, 0.0, float(tokens), (float(tokens),), 0.0, 0.0)
        return sum(_design(work, p))

    assert step_s(gpu, 4) == pytest.approx(step_s(gpu, 1))
    assert step_s(cpu, 4) - step_s(cpu, 1) == pytest.approx(3e-4)



def test_the_sglang_cpu_fit_finds_the_stages_share_the_cores(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """The recorded SGLang default run: C=16 ran two micro-batches of 4 at once and measured 60
    tok/s against C=4's 90, where stages on separate devices would about double it. The fit tries
    the cores the stages share by replay and finds one; its replay is closer than with a core a
    stage; and it no longer predicts K=2 a gain at C=4 (it said +90 % ±44 %; the engine measured
    K=2 at 31-38 tok/s against the defaults' 59-84 back to back, bench/whatif_engines.py). How
    many of the machine's 2 cores the forwards get beside the engine's other processes is the
    fit's to find (1 with every prompt computed; 1.5 since the replay computes only what the
    radix cache does not hold, as the engine does)."""
    from gputrace.whatif.advise import phases_of
    from gputrace.whatif.fit import fit_at_cores

    analysis = analyse(_imported(tmp_path_factory, "sglang", "default"))
    model = fit_model(analysis)
    shared = model.params.shared_cores
    assert 0 < shared < model.params.pp_size and model.params.synchronous_forward
    assert any(f"sharing {shared:g} core" in n for n in model.notes), model.notes
    # a core a stage, with its own shape, scale and queue cost fitted as the fit does
    own_rms, _, _ = fit_at_cores(model.params, 0.0, model.measured, model.labels)
    shared_rms, _, _ = fit_at_cores(model.params, shared, model.measured, model.labels)
    assert shared_rms < own_rms - 0.05, (shared_rms, own_rms)
    k2 = {p.phase: p for p in phases_of(model, {"pp_max_micro_batch_size": 2},
                                        {m.label: 20.0 for m in model.measured})}
    assert k2["C=4"].gain_ratio < k2["C=4"].band_ratio and not k2["C=4"].gains
    assert k2["C=16"].gain_ratio < 0


def test_a_cpu_run_of_one_level_is_taken_to_share_the_cores(tmp_path_factory: pytest.TempPathFactory) -> None:
    """One level cannot tell stages that share the host's cores from stages on a core each (the
    scale absorbs either): a CPU run's stages are then taken to share one, and the note says so."""
    import dataclasses

    analysis = analyse(_imported(tmp_path_factory, "sglang", "default"))
    alone = dataclasses.replace(analysis, metrics=tuple(pm for pm in analysis.metrics if pm.label == "C=16"))
    model = fit_model(alone)
    assert model.labels == ["C=16"] and model.params.shared_cores == 1.0
    assert any("one level cannot show how the stages share" in n for n in model.notes), model.notes


def _logged_prefill_tokens(name: str) -> tuple[float, float]:
    """(#new-token, #cached-token) summed over PP0's prefill lines of a recorded SGLang run."""
    import re

    line = re.compile(r"PP0\] Prefill batch, #new-seq: \d+, #new-token: (\d+), #cached-token: (\d+)")
    new = cached = 0.0
    for text in (fixture_dir("sglang", name) / "engine.log").read_text().splitlines():
        if (m := line.search(text)) is not None:
            new += int(m.group(1))
            cached += int(m.group(2))
    return new, cached


def test_the_replay_computes_only_what_the_radix_cache_does_not_hold(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """[prefill] The recorded SGLang run's prompts repeat a prefix: its prefill lines compute a few
    tokens each and find the rest in the radix cache (#cached-token). The fit takes that share from
    the lines, and its replay computes per request what the engine computed, not the whole prompt
    (the whole prompt, 34 tokens where the engine computed about 2, was fitted as a prompt token
    costing x14 a decode token's, and the K case's prefill turns replayed at 228 ms against the
    engine's 37)."""
    from gputrace.whatif.replay import run_replay

    new, cached = _logged_prefill_tokens("default")
    share = cached / (new + cached)
    assert share > 0.8  # the guard on the recording
    analysis = analyse(_imported(tmp_path_factory, "sglang", "default"))
    model = fit_model(analysis)
    assert model.params.prefix_cached_share == pytest.approx(share, abs=0.02)
    replay = run_replay(model.params, seed=0).result
    computed = float(sum(replay.engine.trace.pf_n))
    started = len([r for r in replay.requests if r.prefilled])
    logged_per_request = new / len([r for r in analysis.run.requests["ok"] if r])
    assert computed / started == pytest.approx(logged_per_request, rel=0.5)
    assert computed / started < 0.25 * model.params.input_tokens
