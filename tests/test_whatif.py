"""The what-if model: fitted to a virtual run's store (only what a capture holds), scored against
the simulator run at the changed setting; `gputrace whatif`; findings' predicted effects."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

from helpers import analyse, gputrace_process

from gputrace.demo import top_recommendation
from gputrace.sim.outputs import write_store
from gputrace.sim.virtual import run_scenario
from gputrace.whatif.effects import with_predicted_effects
from gputrace.whatif.fit import fit_model, initial_params
from gputrace.whatif.groundtruth import format_table, score_change
from gputrace.whatif.replay import run_replay

WITHIN = 0.10  # Must show 1: predicted throughput within 10 % of the simulator's



def test_fit_replays_the_captured_run(motivating_run: Path) -> None:
    """The fitted model, run over the captured levels, gives each phase's throughput within 5 %
    and its TTFT and ITL p50 within 15 %; the deployment is the one the log states."""
    model = fit_model(analyse(motivating_run))
    assert model.params.max_running_requests == 64 and model.params.pp_size == 8
    assert model.params.concurrency == (1, 8, 32, 64)
    for row in model.quality_rows():
        assert row.throughput_error is not None and abs(row.throughput_error) < 0.05, row
        for key in ("ttft_s_p50", "itl_s_p50"):
            measured, simulated = getattr(row, key)
            assert abs(simulated / measured - 1) < 0.15, (key, row)
    assert 0.03 <= model.uncertainty_ratio < 0.05


def test_predicts_k4_within_ten_percent_of_the_simulator() -> None:
    """Fit on the defaults (seed 1), predict K = 4, run the simulator at K = 4: every phase
    within 10 %, the phase K = 4 is for (C=32) faster and C=64 slower, as the simulator has it."""
    scores = score_change("motivating", 1, {"pp_max_micro_batch_size": 4})
    print("\n".join(format_table(scores)))
    assert all(abs(s.error_ratio) < WITHIN for s in scores)
    by_phase = {s.phase: s for s in scores}
    assert by_phase["C=32"].predicted_tok_s > 1.05 * (by_phase["C=32"].measured_tok_s or 0)
    assert by_phase["C=64"].predicted_tok_s < 0.7 * (by_phase["C=64"].measured_tok_s or 0)


def test_fit_reads_prefill_tokens_from_the_prefill_lines(tmp_path: Path) -> None:
    """Where admission holds requests back (kv-bound: TTFT of 30-70 s), the prompt tokens a phase
    prefilled are its prefill lines' #new-token, not the requests it started; the fitted step
    costs then come out at the simulator's own."""
    result = run_scenario("kv-bound", 0)
    write_store(result, tmp_path / "run")
    analysis = analyse(tmp_path / "run")
    read, true = initial_params(analysis)[0], result.params
    fitted = fit_model(analysis).params
    for name in ("launch_s", "weight_read_s", "decode_token_s", "prefill_token_s", "context_token_s"):
        assert abs(getattr(read, name) / getattr(true, name) - 1) < 0.02, (name, getattr(read, name))
        # the replay sends the run's own requests, so it needs no calibration scale (a fresh draw
        # replayed this run 3.5 % off and scaled every cost by that)
        assert abs(getattr(fitted, name) / getattr(true, name) - 1) < 0.02, (name, getattr(fitted, name))


def test_the_replay_sends_the_runs_own_requests(tmp_path: Path) -> None:
    """The fit records each request's (prompt, output) tokens in the order the client sent them
    (a request still running when the recording ended with a draw above what it had generated,
    no longer than the longest output; one that had not started with 0, drawn by the replay) and
    the replay sends them so: where the throughput follows which prompts land where (kv-bound at
    seed 1, C=64: 400 tok/s run, a fresh draw replayed 359-377) the replay of the run as it ran is
    the run within 2 %."""
    result = run_scenario("kv-bound", 1)
    write_store(result, tmp_path / "run")
    analysis = analyse(tmp_path / "run")
    p = initial_params(analysis)[0]
    recorded = list(p.request_lengths)
    assert [prompt for prompt, _ in recorded] == [r.input_tokens for r in result.requests]
    for (_, output), r in zip(recorded, result.requests, strict=True):
        if r.finish_s is not None:
            assert output == r.output_tokens
        elif r.first_token_s is not None:  # generated some: at least about that (the records give
            # its time since its first token, at its phase's median decode rate)
            assert 0.9 * r.generated <= output <= p.max_tokens, (output, r)
    sent = recorded
    replayed = run_replay(p, seed=2).result.requests
    assert len(replayed) >= len(sent)
    for (prompt, output), r in zip(sent, replayed, strict=False):
        assert r.input_tokens == prompt and (output == 0 or r.output_tokens == output), (prompt, output, r)
    model = fit_model(analysis)
    assert not model.correction
    for row in model.quality_rows():
        assert row.throughput_error is not None and abs(row.throughput_error) < 0.02, row


def test_findings_carry_predicted_effects_and_demo_second_run(motivating_run: Path) -> None:
    """Must show 3 (virtual time): every finding with a change gets its predicted effect; the
    top recommendation (as the demo picks it) predicts the second run within 15 %."""
    analysis, _ = with_predicted_effects(analyse(motivating_run))
    predicted = [f for f in analysis.findings if analysis.effect_of(f) is not None]
    assert len(predicted) == len([f for f in analysis.findings if f.change is not None])
    for f in predicted:
        e = analysis.effects[f.key]
        assert f"predicted: {e.measured_tok_s:.0f} -> {e.predicted_tok_s:.0f} tok/s at " \
            f"C={e.concurrency} (±" in analysis.recommendation_of(f)
        assert "predicted:" not in f.recommendation  # the finding itself is as the rules built it
    # the deployment's findings by net gain; those about the offered load after them ([advisor]:
    # "offer at least 8 requests" is a fact about the load, never ranked as a configuration gain)
    deployment = [f.change is not None and f.change.changes_the_deployment for f in predicted]
    assert deployment == sorted(deployment, reverse=True)
    nets = [analysis.effects[f.key].net_gain_tok_s for f, d in zip(predicted, deployment, strict=True) if d]
    assert nets == sorted(nets, reverse=True)
    rec = top_recommendation(analysis)
    assert rec is not None and rec.knob == "--pp-max-micro-batch-size"
    second = run_scenario("motivating", 0, rec.overrides, log=False).ground_truth["phases"]
    truth = {ph["label"]: ph["throughput_tok_s"] for ph in second}
    top = next(f for f in analysis.findings if f.change is not None and f.change.flag == rec.knob)
    effect = analysis.effects[top.key]
    assert rec.predicted == effect
    assert abs(effect.predicted_tok_s / truth[rec.phase] - 1) < 0.15
    for other in effect.other_phases:
        assert abs(other.predicted_tok_s / truth[other.phase] - 1) < 0.15, other


def _whatif(run: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return gputrace_process("whatif", str(run), *args)


def test_whatif_command_json_and_markdown(motivating_run: Path, tmp_path: Path) -> None:
    """`gputrace whatif --set ... --concurrency ...` writes the prediction per level as JSON and
    Markdown: levels the run had pair with their measured phase, the band comes from the fit."""
    done = _whatif(motivating_run, "--set", "max_running_requests=128", "--set", "pp_max_micro_batch_size=4",
                   "--concurrency", "32,64,128", "--format", "md,json", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    doc = json.loads((tmp_path / "whatif.json").read_text())
    assert doc["changes"] == {"max_running_requests": "128", "pp_max_micro_batch_size": "4",
                              "concurrency": "32,64,128"}
    levels = {ph["concurrency"]: ph for ph in doc["phases"]}
    assert set(levels) == {32, 64, 128}
    assert levels[128]["measured"] is None and levels[32]["measured"]["label"] == "C=32"
    assert levels[32]["gain_ratio"] > 0.05  # K = 4 spreads 32 requests over the 8 slots
    assert len(levels[64]["predicted"]["bubble_fraction_by_stage"]) == 8
    md = (tmp_path / "whatif.md").read_text()
    assert f"| C=32 | 32 | {levels[32]['measured']['throughput_tok_s']:.0f} -> " in md and "## The fit" in md


def test_whatif_rejects_unknown_keys_and_impossible_values(motivating_run: Path) -> None:
    """A key the model cannot change or an impossible value: a one-line error naming the valid keys."""
    for args, said in ((("--set", "gpu_name=H200"), "cannot change 'gpu_name'"),
                       (("--set", "max_running_requests=0"), "max_running_requests must be >= 1"),
                       (("--set", "pp_max_micro_batch_size=four"), "cannot use 'four'")):
        done = _whatif(motivating_run, *args)
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and said in lines[0] and "valid keys: pp_max_micro_batch_size" in lines[0]


def test_effect_text_claims_only_what_the_change_itself_moves() -> None:
    """Predictions are calibrated (measured x model(change) / model(as run)), so the text weighs
    them against the measurement: a phase the change lowers past the band is a cost, one inside
    the band is none, whatever the model's own replay of the run was."""
    from gputrace.analysis.predicted import PhaseEffect, PredictedEffect

    effect = PredictedEffect("C=32", 32, 1058.6, 1284.8, 1000.0, band_ratio=0.19, gain_ratio=0.2137,
                             within_uncertainty=False, net_gain_tok_s=0.0, other_phases=(
                                 PhaseEffect("C=64", 64, 2104.0, 1290.0, 2538.0),
                                 PhaseEffect("C=8", 8, 273.0, 240.0, 201.0)))
    assert effect.text() == ("predicted: 1059 -> 1285 tok/s at C=32 (±19%); costs C=64 2104 -> "
                             "1290 tok/s")
    # the model's replay unchanged does not enter: the prediction is already relative to it
    assert dataclasses.replace(effect, unchanged_tok_s=1266.0).text() == effect.text()
    loss = dataclasses.replace(effect, predicted_tok_s=700.0, gain_ratio=-0.34)
    assert loss.text().startswith("predicted: 1059 -> 700 tok/s at C=32 (±19%); a loss at this phase")


def test_a_run_of_many_phases_replays_a_bounded_number_of_levels() -> None:
    """A long run's hundreds of phases are not each replayed: at most MAX_REPLAYED_LEVELS levels
    spread over the captured ones, each phase taking its nearest level's replay (its own label
    and level kept); a run of few phases replays as captured."""
    from gputrace.sim.params import make_params
    from gputrace.whatif.fit import MAX_REPLAYED_LEVELS, replay_outcomes, replayed_levels
    from gputrace.whatif.outcome import trace_outcomes
    from gputrace.whatif.replay import run_replay

    levels = tuple(1 + (7 * i) % 60 for i in range(40))  # 40 phases, 40 distinct levels in 1..60
    p = make_params({"concurrency": levels, "phase_s": 3.0})
    reduced = replayed_levels(p.concurrency)
    assert reduced is not None
    ran_levels, nearest = reduced
    assert len(ran_levels) == MAX_REPLAYED_LEVELS and list(ran_levels) == sorted(ran_levels)
    assert ran_levels[0] == min(levels) and ran_levels[-1] == max(levels)
    labels = [f"phase {i}" for i in range(len(levels))]
    out = replay_outcomes(p, labels)
    whole = run_replay(dataclasses.replace(p, concurrency=ran_levels))
    ran = trace_outcomes(whole.result, None, [(ph.rest_s, ph.rest_tok_s) for ph in whole.phases])
    assert [o.label for o in out] == labels and [o.concurrency for o in out] == list(levels)
    for c, o, j in zip(levels, out, nearest, strict=True):
        assert abs(ran_levels[j] - c) == min(abs(r - c) for r in ran_levels)
        assert o.throughput_tok_s == ran[j].throughput_tok_s
    few = dataclasses.replace(p, concurrency=levels[:4])
    assert replayed_levels(few.concurrency) is None
    ran_few = run_replay(few)
    assert replay_outcomes(few, labels[:4]) == trace_outcomes(
        ran_few.result, labels[:4], [(ph.rest_s, ph.rest_tok_s) for ph in ran_few.phases])


def test_a_load_of_fixed_lengths_is_replayed_once_for_every_seed(monkeypatch) -> None:
    """The seed draws only the requests' lengths: with none drawn, each seed's replay is the
    same run, so the median of REPLAY_SEEDS is one replay's; with lengths drawn, each seed runs."""
    from gputrace.sim.params import make_params
    from gputrace.whatif import fit

    fixed = make_params({"concurrency": (2, 8), "phase_s": 2.0, "max_tokens": 64})
    assert not fixed.draws_lengths
    assert fit.replay_outcomes(fixed, None, 0) == fit.replay_outcomes(fixed, None, 1)
    drawn = dataclasses.replace(fixed, output_tokens_jitter=0.5)
    assert drawn.draws_lengths
    assert fit.replay_outcomes(drawn, None, 0) != fit.replay_outcomes(drawn, None, 1)

    ran: list[int] = []
    real = fit.replay_outcomes

    def counted(p, labels, seed=0):  # type: ignore[no-untyped-def]
        ran.append(seed)
        return real(p, labels, seed)

    monkeypatch.setattr(fit, "replay_outcomes", counted)
    runs = fit.replay_seeds(fixed, None)
    assert ran == [fit.REPLAY_SEEDS[0]] and len(runs) == len(fit.REPLAY_SEEDS)
    assert all(r == runs[0] for r in runs)
    ran.clear()
    fit.replay_seeds(drawn, None)
    assert ran == list(fit.REPLAY_SEEDS)
