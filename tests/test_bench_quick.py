"""Every bench in bench/ runs in its quick mode (``--quick``: small inputs, one repeat, the code
path users run) in a subprocess and prints its figures, so a change that breaks a bench fails the
suite ([speed] Must show 4: bench/agent.py crashed unseen for weeks). A new bench needs its entry
here. Only that each bench runs and reports is checked: its figures are measured, not asserted."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import require_binary
from engine_servers import engine_tier_missing
from testhosts import LIBFAKETIME_CANDIDATES, libfaketime

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
NUMBER = r"[\d,]+(?:\.\d+)?"


@dataclass(frozen=True, slots=True)
class QuickBench:
    """What a bench's quick run must print, and what it needs."""

    figures: str  # a regular expression matching the line(s) with its figures
    binaries: tuple[str, ...] = ()  # system binaries it needs (the test skips, or fails under CI)
    engines: bool = False  # the real engines of .venv-engines
    slow: bool = False  # more than ~8 s on a 2-core machine
    timeout_s: float = 120.0


QUICK: dict[str, QuickBench] = {
    "advisor": QuickBench(rf"\d+/\d+ runs: the advice gains.*\n.*median {NUMBER} s", slow=True),
    "agent": QuickBench(rf"8 GPUs at 10 Hz under 0.2 % of one core: {NUMBER} %"
                        rf"(?s:.*)/metrics for 8 GPUs \(default labels\) under 2 ms: {NUMBER} ms"),
    # agent_h200 is handled on its own (test_agent_h200_quick_says_why_it_skips)
    "agent_healthz": QuickBench(rf"/healthz, 2 clients paging +n= *\d+ +p50 +{NUMBER} ms +p99 +{NUMBER} ms"),
    "calibration": QuickBench(rf"C=1 K=8 512 tok +{NUMBER} +{NUMBER} +{NUMBER}"),
    "cli_startup": QuickBench(rf"gputrace --help +{NUMBER} ms +\({NUMBER}x the bare interpreter\)"),
    "collector_scale": QuickBench(rf"lag_ms_p50 +{NUMBER} +{NUMBER}(?s:.*)log_lines_lost +\d+ +\d+",
                                  binaries=("sshd", "ssh-keygen"), slow=True, timeout_s=240),
    "engine_tier_busy": QuickBench(r"runs passed whole: 1 of 1", engines=True, slow=True, timeout_s=1200),
    "ingest": QuickBench(rf"gputrace import: .*speed ratio to the scan {NUMBER}(?s:.*)"
                         rf"gputrace parse : .*speed ratio to the scan {NUMBER}"),
    "ingest_live": QuickBench(rf"SSH / local: {NUMBER}x", binaries=("sshd", "ssh-keygen")),
    "load": QuickBench(rf"PASS: C=32 kept mean {NUMBER}, min {NUMBER} in flight"),
    "prefill_engines_vllm": QuickBench(rf"median ratio x{NUMBER} per wall second, x{NUMBER} per engine "
                                       r"CPU-second", engines=True, slow=True, timeout_s=900),
    "report": QuickBench(rf"8 GPUs x 0.05 h +{NUMBER} \({NUMBER}-{NUMBER}\) .* {NUMBER}x +{NUMBER}x",
                         slow=True),
    "report_memory": QuickBench(rf"gputrace report +{NUMBER} s wall +{NUMBER} s CPU +{NUMBER} MB peak RSS",
                                slow=True),
    "report_prometheus": QuickBench(rf"ratio report --prometheus / reference: {NUMBER}x",
                                    binaries=("prometheus", "promtool"), slow=True),
    "robust": QuickBench(r"8\. 100 marks/s for 0\.5 s \(50\): acknowledged \d+, stored \d+",
                         binaries=("sshd", "ssh-keygen"), slow=True, timeout_s=240),
    "sim": QuickBench(rf"simulated / wall +{NUMBER} x"),
    "store": QuickBench(rf"read back as columns: store +{NUMBER} rows/s +numpy.load +{NUMBER} rows/s"),
    "whatif": QuickBench(rf"\d+/\d+ predictions within 10%(?s:.*)fit .*: median {NUMBER} s", slow=True),
    "whatif_engines": QuickBench(rf"\| sglang \| 0 \| .* \| {NUMBER} \|", engines=True, slow=True,
                                 timeout_s=1800),
}


def _run_quick(name: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    return subprocess.run([sys.executable, str(BENCH / f"{name}.py"), "--quick"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout_s)


def test_every_bench_has_a_quick_run() -> None:
    """A bench added to bench/ without an entry here (so never run by the suite) fails; a module
    the benches import (no ``__main__``: bench/engine_pairs.py) is no bench."""
    scripts = {p.stem for p in BENCH.glob("*.py") if '__name__ == "__main__"' in p.read_text()}
    assert scripts == {*QUICK, "agent_h200"}


def _params() -> list[object]:
    params = []
    for name, bench in sorted(QUICK.items()):
        marks = [pytest.mark.slow] * bench.slow + [pytest.mark.system] * bool(bench.binaries)
        marks += [pytest.mark.engine] * bench.engines
        params.append(pytest.param(name, marks=marks, id=name))
    return params


@pytest.mark.parametrize("name", _params())
def test_bench_runs_in_quick_mode_and_prints_its_figures(name: str) -> None:
    """``python bench/NAME.py --quick`` exits 0 and prints the line(s) with its figures."""
    bench = QUICK[name]
    for binary in bench.binaries:
        require_binary(binary)
    if name == "collector_scale" and libfaketime() is None:  # each test host's own clock
        require_binary(*LIBFAKETIME_CANDIDATES)
    if bench.engines and (reason := engine_tier_missing()) is not None:
        if os.environ.get("GPUTRACE_REQUIRE_ENGINE_TESTS") == "1":
            pytest.fail(reason + "; GPUTRACE_REQUIRE_ENGINE_TESTS=1 makes this a failure")
        pytest.skip(reason)
    done = _run_quick(name, bench.timeout_s)
    tail = (done.stdout[-3000:] + "\n--- stderr ---\n" + done.stderr[-3000:])
    assert done.returncode == 0, tail
    assert re.search(bench.figures, done.stdout), tail


def test_agent_h200_quick_says_why_it_skips() -> None:
    """The H200 device check needs an NVIDIA GPU, nvidia-smi and PyTorch; it has no simulated path
    (its point is the real driver against nvidia-smi). Without a GPU, or without --out, its quick
    run exits 0 and says why it measured nothing; this test checks that line, then skips with it."""
    done = _run_quick("agent_h200", 60)
    assert done.returncode == 0, done.stderr[-3000:]
    reason = "agent_h200: skipped (needs an NVIDIA GPU with nvidia-smi, and --out DIR)"
    assert done.stdout.strip() == reason, done.stdout
    if shutil.which("nvidia-smi") is None:
        pytest.skip(reason.removeprefix("agent_h200: "))
    pytest.skip("run it on the device machine: python3 bench/agent_h200.py --out $OUT")
