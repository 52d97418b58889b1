"""`gputrace demo`: the whole chain on loopback with no GPU: the simulator's real-time SGLang PP8
server, an agent with the simulated backend, and `gputrace run` (collector + load generator), as
real processes; each run is then analysed here (``analyse_run``) and its report written from that
analysis, which the demo reads its decisions from. Three runs of the motivating deployment: its
defaults; gputrace's own top recommendation from the first run's findings, applied; and the
change people try first (--pp-max-micro-batch-size 64); then the comparisons.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gputrace.analyse import analyse_run
from gputrace.analysis.predicted import PredictedEffect
from gputrace.analysis.run import Analysis
from gputrace.errors import SourceError, UsageError
from gputrace.report.render import write_report
from gputrace.store import Store

SIM_HOST = "sim-node0"


@dataclass(frozen=True, slots=True)
class DemoPlan:
    """What one demo run does; `quick` shortens every level."""

    concurrency: tuple[int, ...] = (1, 8, 32, 64)
    level_s: float = 9.0
    max_tokens: int = 256
    speed: float = 1.0

    @classmethod
    def for_mode(cls, quick: bool) -> DemoPlan:
        return cls(level_s=4.0) if quick else cls()


SCENARIO = "motivating"
# The engine flags a finding can name, as the simulator's parameters that make them.
FLAG_PARAMS = {"--pp-max-micro-batch-size": "pp_max_micro_batch_size",
               "--max-running-requests": "max_running_requests",
               "--decode-log-interval": "decode_log_interval",
               "--pp-async-batch-depth": "pp_async_batch_depth"}
FIRST_TRY = {"pp_max_micro_batch_size": 64}  # what people set first when the log says 8 running


@dataclass(frozen=True, slots=True)
class DemoRun:
    label: str
    scenario: str
    run_dir: Path
    report_dir: Path
    analysis: Analysis  # what its report renders
    overrides: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True, slots=True)
class Recommendation:
    """The first finding of a run whose change the simulated engine can make."""

    cause: str
    phase: str
    knob: str
    value: int
    text: str
    predicted: PredictedEffect | None = None  # the what-if model's effect (findings.json "predicted")

    @property
    def overrides(self) -> dict[str, Any]:
        return {FLAG_PARAMS[self.knob]: self.value}


def top_recommendation(analysis: Analysis) -> Recommendation | None:
    """The first finding (ranked most important first) with an engine flag and value."""
    for f in analysis.findings:
        if f.change is not None and f.change.flag in FLAG_PARAMS and f.change.value:
            return Recommendation(f.cause, f.phase, f.change.flag, f.change.value,
                                  analysis.recommendation_of(f), analysis.effect_of(f))
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _gputrace(*args: str) -> list[str]:
    return [sys.executable, "-m", "gputrace", *args]


def _wait_http(url: str, proc: subprocess.Popen[bytes], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SourceError(f"demo: the {what} exited with status {proc.returncode} before it was ready")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1) as resp:
            if resp.status == 200:
                return
        time.sleep(0.1)
    raise SourceError(f"demo: the {what} did not answer {url} within {timeout_s:.0f} s")


@contextlib.contextmanager
def child_process(argv: list[str], log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A child process whose output goes to a log file; stopped with SIGTERM (then SIGKILL)."""
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def write_config(path: Path, log_file: Path, agent_port: int, pp_size: int = 8) -> None:
    path.write_text(
        "# written by `gputrace demo`: one local host running the simulated SGLang PP8 server\n"
        f'[run]\nname = "{path.stem}"\n\n'
        f'[[hosts]]\nname = "{SIM_HOST}"\nagent = "127.0.0.1:{agent_port}"\n\n'
        f'[hosts.log]\nkind = "file"\npath = {json.dumps(str(log_file))}\nengine = "sglang"\n\n'
        f"[topology]\npp_size = {pp_size}\ntp_size = 1\n"
    )


# One report at a time: the runs capture side by side, but the figures are drawn with pyplot, whose
# state (rcParams, the current figure) is global to the process.
_REPORTING = threading.Lock()


def run_one(out: Path, label: str, scenario: str, plan: DemoPlan,
            say: Callable[[str], None], overrides: dict[str, Any] | None = None) -> DemoRun:
    """Serve the scenario (with ``overrides``), capture a sweep against it with `gputrace run`,
    analyse the run and write its report."""
    sets = [f"--set={key}={value}" for key, value in (overrides or {}).items()]
    work = out / "work" / label
    work.mkdir(parents=True, exist_ok=True)
    log_file, feed = work / "sglang.log", work / "gpu-feed.ndjson"
    sim_port, agent_port, collector_port = free_port(), free_port(), free_port()
    config = work / f"{label}.toml"
    write_config(config, log_file, agent_port)
    run_dir = out / label
    changed = ", ".join(f"{k}={v}" for k, v in (overrides or {}).items()) or "defaults"
    say(f"[{label}] simulated SGLang PP8 ({scenario}, {changed}) on :{sim_port}, agent on :{agent_port}")
    sim_argv = _gputrace("sim", "serve", "--scenario", scenario, "--port", str(sim_port),
                         "--log", str(log_file), "--gpu-feed", str(feed), "--speed", str(plan.speed), *sets)
    with child_process(sim_argv, work / "sim.out") as sim:
        _wait_http(f"http://127.0.0.1:{sim_port}/v1/models", sim, "simulator")
        agent_argv = _gputrace("agent", "--backend", "sim", "--sim-feed", str(feed),
                               "--listen", f"127.0.0.1:{agent_port}", "--interval", "0.1",
                               "--host-name", SIM_HOST, "--topology", "pp=8,tp=1")
        with child_process(agent_argv, work / "agent.out") as agent:
            _wait_http(f"http://127.0.0.1:{agent_port}/healthz", agent, "agent")
            say(f"[{label}] sweeping C={','.join(map(str, plan.concurrency))}, "
                f"{plan.level_s:.0f} s per level")
            run_argv = _gputrace(
                "run", "--config", str(config), "--out", str(run_dir),
                "--listen", f"127.0.0.1:{collector_port}",
                "--url", f"http://127.0.0.1:{sim_port}", "--model", "default",
                "--concurrency", ",".join(map(str, plan.concurrency)),
                "--duration-per-level", str(plan.level_s), "--max-tokens", str(plan.max_tokens),
                "--warmup", "0", "--drain", "0.5", "--no-report")
            with open(work / "run.out", "wb") as run_log:
                status = subprocess.run(run_argv, stdout=run_log, stderr=subprocess.STDOUT,
                                        check=False).returncode
            if status != 0:
                tail = (work / "run.out").read_text(errors="replace").strip().splitlines()[-5:]
                raise SourceError(f"demo: `gputrace run` for {label} failed (status {status}): "
                                  + " | ".join(tail))
    report_dir = run_dir / "report"
    say(f"[{label}] analysing the run and writing its report")
    with _REPORTING, Store.open(run_dir, read_only=True) as store:
        analysis = analyse_run(store)
        write_report(analysis, report_dir)
    return DemoRun(label, scenario, run_dir, report_dir, analysis, tuple((overrides or {}).items()))


def compare(out: Path, a: DemoRun, b: DemoRun) -> Path:
    target = out / f"compare-{a.label}-{b.label}"
    status = subprocess.run(_gputrace("compare", str(a.run_dir), str(b.run_dir), "--out", str(target)),
                            capture_output=True, text=True, check=False)
    if status.returncode != 0:
        raise SourceError(f"demo: compare failed: {status.stderr.strip()[-300:]}")
    return target


@dataclass(frozen=True, slots=True)
class DemoResult:
    defaults: DemoRun
    recommended: DemoRun | None  # None when the defaults' run had no finding to apply
    recommendation: Recommendation | None
    first_try: DemoRun
    comparisons: tuple[Path, ...]

    @property
    def runs(self) -> list[DemoRun]:
        return [r for r in (self.defaults, self.recommended, self.first_try) if r is not None]


def run_demo(out: Path, quick: bool, say: Callable[[str], None]) -> DemoResult:
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"--out {out}: not empty; choose another directory or remove it")
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("GPUTRACE_DEMO", "1")
    plan = DemoPlan.for_mode(quick)
    # The deployments are independent processes on loopback: the defaults and the first try run
    # side by side; gputrace's recommendation needs the defaults' findings first.
    with ThreadPoolExecutor(max_workers=2) as pool:
        defaults_future = pool.submit(run_one, out, "defaults", SCENARIO, plan, say)
        first_future = pool.submit(run_one, out, "k64", SCENARIO, plan, say, FIRST_TRY)
        defaults = defaults_future.result()
        rec = top_recommendation(defaults.analysis)
        recommended = None
        if rec is None:
            say("[recommended] the defaults' run has no finding with a setting to change")
        else:
            say(f"[recommended] gputrace's top recommendation: {rec.knob} {rec.value} "
                f"({rec.cause} at {rec.phase})")
            recommended = run_one(out, "recommended", SCENARIO, plan, say, rec.overrides)
        first_try = first_future.result()
    comparisons = [compare(out, defaults, run) for run in (recommended, first_try) if run is not None]
    return DemoResult(defaults, recommended, rec, first_try, tuple(comparisons))
