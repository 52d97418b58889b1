"""`gputrace sim` on the command line: a run store with its log and CSV, overrides, listing."""

from __future__ import annotations

import json

from helpers import cli, gputrace_process


def test_sim_writes_store_log_and_csv(tmp_path):
    """`gputrace sim --scenario ... --out ...` writes the store, --log-out and --gpu-csv."""
    params = tmp_path / "p.toml"
    params.write_text("[sim]\nphase_s = 6.0\ndrain_s = 1.0\n")
    out = tmp_path / "run"
    result = cli(["sim", "--scenario", "healthy", "--out", str(out), "--seed", "4",
                  "--params", str(params), "--set", "concurrency=16,64",
                  "--log-out", str(tmp_path / "s.log"), "--gpu-csv", str(tmp_path / "g.csv")])
    assert result.exit_code == 0, result.output
    assert "C=16" in result.output and "C=64" in result.output
    meta = json.loads((out / "meta.json").read_text())
    gt = meta["extra"]["ground_truth"]
    assert gt["seed"] == 4 and [ph["label"] for ph in gt["phases"]] == ["C=16", "C=64"]
    assert (tmp_path / "s.log").read_text().count("Decode batch") > 0
    assert (tmp_path / "g.csv").read_text().startswith("timestamp, index")


def test_sim_lists_scenarios_and_refuses_bad_use(tmp_path):
    """--list names every scenario; a missing --out or an unknown parameter is a one-line error."""
    listed = cli(["sim", "--list"])
    assert listed.exit_code == 0 and "microbatch-cap" in listed.output and "pcie-bound" in listed.output
    missing = cli(["sim", "--scenario", "healthy"])
    assert missing.exit_code != 0 and "--out" in str(missing.exception or missing.output)
    bad = cli(["sim", "--scenario", "healthy", "--out", str(tmp_path / "x"), "--set", "bogus=1"])
    assert bad.exit_code != 0 and "bogus" in str(bad.exception or bad.output)
    serve_help = cli(["sim", "serve", "--help"])
    assert serve_help.exit_code == 0 and "--gpu-feed" in serve_help.output


def test_scenarios_are_told_in_their_engines_flags_and_only_a_served_engine_serves(tmp_path):
    """The scenario texts take each flag from their engine's knobs (vLLM's --max-num-seqs, SGLang's
    --pp-max-micro-batch-size); `sim serve` asks the engine whether it is served in real time: vLLM's
    model is not, a one-line error (exit 2) before anything is started."""
    listed = {line.split()[0]: line for line in cli(["sim", "--list"]).output.splitlines()}
    assert "vLLM, PP8, --max-num-seqs 32" in listed["vllm-admission"]
    assert "--pp-max-micro-batch-size 2 below a pool" in listed["microbatch-cap"]
    assert "SGLang's default --decode-log-interval 40" in listed["log-aliased"]
    assert not any("{" in line for line in listed.values())
    refused = gputrace_process("sim", "serve", "--scenario", "vllm-admission", "--port", "0",
                               "--log", str(tmp_path / "s.log"), timeout_s=60)
    assert refused.returncode == 2, refused.stderr
    [line] = refused.stderr.strip().splitlines()  # one line
    assert line.endswith(
        "sim serve: only the SGLang model serves in real time; the vLLM model runs in virtual time "
        "(gputrace sim --scenario ... --set engine=vllm)")
    assert not (tmp_path / "s.log").exists()
