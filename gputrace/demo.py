"""`gputrace demo`: the whole chain on loopback with no GPU: the simulator's real-time SGLang PP8
server, an agent with the simulated backend, and `gputrace run` (collector + load generator +
report), as real processes. Three runs of the motivating deployment: its defaults; gputrace's own
top recommendation from the first run's findings, applied; and the change people try first
(--pp-max-micro-batch-size 64); then the comparisons.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gputrace.errors import SourceError, UsageError

SIM_HOST = "sim-node0"


@dataclass(frozen=True, slots=True)
class DemoPlan:
    """What one demo run does; `quick` shortens every level."""

    concurrency: tuple[int, ...] = (1, 8, 32, 64)
    level_s: float = 9.0
    max_tokens: int = 256
    speed: float = 1.0
    nodes: int = 1  # the PP8 engine over this many simulated nodes (SGLang's --nnodes)

    @classmethod
    def for_mode(cls, quick: bool, nodes: int = 1) -> DemoPlan:
        return cls(level_s=4.0, nodes=nodes) if quick else cls(nodes=nodes)


SCENARIO = "motivating"
# The engine flags a finding can name, as the simulator's parameters that make them.
FLAG_PARAMS = {"--pp-max-micro-batch-size": "pp_max_micro_batch_size",
               "--max-running-requests": "max_running_requests",
               "--decode-log-interval": "decode_log_interval",
               "--pp-async-batch-depth": "pp_async_batch_depth"}
FIRST_TRY = {"pp_max_micro_batch_size": 64}  # what people set first when the log says 8 running
# Every simulated engine logs as the README asks of a real one: every decode step. With the
# simulator's own default (every 9th) the first report a user saw carried a sampling caveat.
LOGGED_AS_ADVISED = {"decode_log_interval": 1}


@dataclass(frozen=True, slots=True)
class DemoRun:
    label: str
    scenario: str
    run_dir: Path
    report_dir: Path
    overrides: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True, slots=True)
class Recommendation:
    """The first finding of a run whose change the simulated engine can make."""

    cause: str
    phase: str
    knob: str
    value: int
    text: str
    predicted: dict[str, Any] | None = None  # the what-if model's effect (findings.json "predicted")

    @property
    def overrides(self) -> dict[str, Any]:
        return {FLAG_PARAMS[self.knob]: self.value}


def top_recommendation(doc: dict[str, Any]) -> Recommendation | None:
    """From findings.json (ranked most important first): the first with an engine flag and value."""
    for f in doc.get("findings", []):
        details = f.get("change") or {}
        knob, value = details.get("knob"), details.get("value")
        if knob in FLAG_PARAMS and isinstance(value, int) and value > 0:
            return Recommendation(f["cause"], f["phase"], knob, value, f.get("recommendation", ""),
                                  f.get("predicted"))
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


def node_name(rank: int) -> str:
    return f"sim-node{rank}"


def write_config(path: Path, log_files: list[Path], agent_ports: list[int], pp_size: int = 8) -> None:
    """One local [[hosts]] per simulated node (node_rank in order), with its log and agent."""
    hosts = "".join(
        f'[[hosts]]\nname = "{node_name(rank)}"\nagent = "127.0.0.1:{port}"\nnode_rank = {rank}\n\n'
        f'[hosts.log]\nkind = "file"\npath = {json.dumps(str(log_file))}\nengine = "sglang"\n\n'
        for rank, (log_file, port) in enumerate(zip(log_files, agent_ports, strict=True)))
    nodes = len(log_files)
    path.write_text(
        f"# written by `gputrace demo`: the simulated SGLang PP{pp_size} server on {nodes} local node(s)\n"
        f'[run]\nname = "{path.stem}"\n\n{hosts}'
        f"[topology]\npp_size = {pp_size}\ntp_size = 1\nnnodes = {nodes}\n"
    )


def run_one(out: Path, label: str, scenario: str, plan: DemoPlan,
            say: Callable[[str], None], overrides: dict[str, Any] | None = None) -> DemoRun:
    """Serve the scenario (with ``overrides``), capture a sweep against it with `gputrace run`,
    write its report."""
    sets = [f"--set={key}={value}" for key, value in {**LOGGED_AS_ADVISED, **(overrides or {})}.items()]
    work = out / "work" / label
    work.mkdir(parents=True, exist_ok=True)
    nodes = range(plan.nodes)
    logs, feeds = [work / f"sglang-{r}.log" for r in nodes], [work / f"gpu-feed-{r}.ndjson" for r in nodes]
    sim_port, collector_port, dist_port = free_port(), free_port(), free_port()
    agent_ports = [free_port() for _ in nodes]
    config = work / f"{label}.toml"
    write_config(config, logs, agent_ports)
    run_dir = out / label
    changed = ", ".join(f"{k}={v}" for k, v in (overrides or {}).items()) or "defaults"
    where = f" over {plan.nodes} nodes" if plan.nodes > 1 else ""
    say(f"[{label}] simulated SGLang PP8{where} ({scenario}, {changed}) on :{sim_port}, "
        f"agents on :{', :'.join(map(str, agent_ports))}")
    multi = (["--nnodes", str(plan.nodes), "--dist-init-addr", f"127.0.0.1:{dist_port}"]
             if plan.nodes > 1 else [])
    with contextlib.ExitStack() as stack:
        sims, agents = [], []
        for rank in nodes:
            sim_argv = _gputrace("sim", "serve", "--scenario", scenario, "--port", str(sim_port),
                                 "--log", str(logs[rank]), "--gpu-feed", str(feeds[rank]), "--speed",
                                 str(plan.speed), *multi, *(["--node-rank", str(rank)] if multi else []),
                                 *sets)
            sims.append(stack.enter_context(child_process(sim_argv, work / f"sim-{rank}.out")))
        for rank in nodes:  # the nodes join node 0 before it serves
            agent_argv = _gputrace("agent", "--backend", "sim", "--sim-feed", str(feeds[rank]),
                                   "--listen", f"127.0.0.1:{agent_ports[rank]}", "--interval", "0.1",
                                   "--host-name", node_name(rank),
                                   "--topology", f"pp=8,tp=1,nnodes={plan.nodes},node_rank={rank}")
            agents.append(stack.enter_context(child_process(agent_argv, work / f"agent-{rank}.out")))
        _wait_http(f"http://127.0.0.1:{sim_port}/v1/models", sims[0], "simulator")
        for rank in nodes:
            _wait_http(f"http://127.0.0.1:{agent_ports[rank]}/healthz", agents[rank], "agent")
        say(f"[{label}] sweeping C={','.join(map(str, plan.concurrency))}, "
            f"{plan.level_s:.0f} s per level")
        run_argv = _gputrace(
            "run", "--config", str(config), "--out", str(run_dir),
            "--listen", f"127.0.0.1:{collector_port}",
            "--url", f"http://127.0.0.1:{sim_port}", "--model", "default",
            "--concurrency", ",".join(map(str, plan.concurrency)),
            "--duration-per-level", str(plan.level_s), "--max-tokens", str(plan.max_tokens),
            "--warmup", "0", "--drain", "0.5")
        with open(work / "run.out", "wb") as run_log:
            status = subprocess.run(run_argv, stdout=run_log, stderr=subprocess.STDOUT,
                                    check=False).returncode
        if status != 0:
            tail = (work / "run.out").read_text(errors="replace").strip().splitlines()[-5:]
            raise SourceError(f"demo: `gputrace run` for {label} failed (status {status}): "
                              + " | ".join(tail))
    return DemoRun(label, scenario, run_dir, run_dir / "report", tuple((overrides or {}).items()))


def compare(out: Path, a: DemoRun, b: DemoRun) -> Path:
    target = out / f"compare-{a.label}-{b.label}"
    status = subprocess.run(_gputrace("compare", str(a.run_dir), str(b.run_dir), "--out", str(target)),
                            capture_output=True, text=True, check=False)
    if status.returncode != 0:
        raise SourceError(f"demo: compare failed: {status.stderr.strip()[-300:]}")
    return target


def findings_of(run: DemoRun) -> dict[str, Any]:
    path = run.report_dir / "findings.json"
    try:
        doc: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SourceError(f"demo: no readable findings for {run.label} at {path}: {exc}") from exc
    return doc


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


def run_demo(out: Path, quick: bool, say: Callable[[str], None], nodes: int = 1) -> DemoResult:
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"--out {out}: not empty; choose another directory or remove it")
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("GPUTRACE_DEMO", "1")
    if nodes < 1 or 8 % nodes:
        raise UsageError(f"--nodes {nodes}: PP8 splits over 1, 2, 4 or 8 nodes")
    plan = DemoPlan.for_mode(quick, nodes)
    # The deployments are independent processes on loopback: the defaults and the first try run
    # side by side; gputrace's recommendation needs the defaults' findings first.
    with ThreadPoolExecutor(max_workers=2) as pool:
        defaults_future = pool.submit(run_one, out, "defaults", SCENARIO, plan, say)
        first_future = pool.submit(run_one, out, "k64", SCENARIO, plan, say, FIRST_TRY)
        defaults = defaults_future.result()
        rec = top_recommendation(findings_of(defaults))
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
