"""A live chain on loopback for the watch and dashboard tests, as real processes: the simulator's
real-time SGLang PP8 server (OpenAI API, scheduler log, GPU feed), an agent tailing the feed, and the
collector's config that follows both (the layout `gputrace demo` runs)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from conftest import require_binary
from helpers import free_port

from gputrace.demo import child_process

HOST = "sim-node0"
PP_SIZE = 8



def gputrace_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "gputrace", *args]


def wait_until(predicate: Callable[[], object], timeout_s: float = 30.0, what: str = "condition",
               proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the process exited with status {proc.returncode}")
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"{what}: not met within {timeout_s:.0f} s")


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def get_json(url: str) -> dict[str, object]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        doc: dict[str, object] = json.loads(resp.read())
        return doc


process = child_process  # the demo's own way of running a child process


@dataclass(frozen=True)
class Chain:
    """The running engine and agent, and a collector config that follows them."""

    engine_url: str
    agent_port: int
    config: Path
    work: Path


def write_config(path: Path, log_file: Path, agent_port: int) -> Path:
    path.write_text(f'[run]\nname = "live"\n\n'
                    f'[[hosts]]\nname = "{HOST}"\nagent = "127.0.0.1:{agent_port}"\n\n'
                    f'[hosts.log]\nkind = "file"\npath = {json.dumps(str(log_file))}\nengine = "sglang"\n\n'
                    f"[topology]\npp_size = {PP_SIZE}\ntp_size = 1\n")
    return path


@contextlib.contextmanager
def sim_chain(work: Path, scenario: str = "microbatch-cap", sets: tuple[str, ...] = ()) -> Iterator[Chain]:
    """The simulator's real-time SGLang PP8 server (log + GPU feed) and an agent tailing the feed;
    ``sets``: the simulator's parameters changed (``name=value``)."""
    work.mkdir(parents=True, exist_ok=True)
    log_file, feed = work / "sglang.log", work / "gpu-feed.ndjson"
    sim_port, agent_port = free_port(), free_port()
    with process(gputrace_argv("sim", "serve", "--scenario", scenario, "--port", str(sim_port),
                               "--log", str(log_file), "--gpu-feed", str(feed),
                               *(f"--set={item}" for item in sets)), work / "sim.out") as sim:
        wait_until(lambda: http_ok(f"http://127.0.0.1:{sim_port}/v1/models"), what="simulator", proc=sim)
        with process(gputrace_argv("agent", "--backend", "sim", "--sim-feed", str(feed),
                                   "--listen", f"127.0.0.1:{agent_port}", "--interval", "0.1",
                                   "--host-name", HOST, "--topology", f"pp={PP_SIZE},tp=1"),
                     work / "agent.out") as agent:
            wait_until(lambda: http_ok(f"http://127.0.0.1:{agent_port}/healthz"), what="agent", proc=agent)
            yield Chain(f"http://127.0.0.1:{sim_port}", agent_port,
                        write_config(work / "gputrace.toml", log_file, agent_port), work)


@contextlib.contextmanager
def prometheus(work: Path, targets: dict[str, int], interval_s: int = 1,
               keep: dict[str, str] | None = None) -> Iterator[str]:
    """Prometheus scraping each loopback target every ``interval_s``; yields its base URL.
    ``keep``: job -> a regular expression of the metric names that job stores (the rest dropped)."""
    binary = require_binary("prometheus")  # on PATH, as the engine tier checks it
    keep = keep or {}

    def job(name: str, port: int) -> str:
        text = f'  - job_name: {name}\n    static_configs:\n      - targets: ["127.0.0.1:{port}"]\n'
        if name in keep:
            text += ("    metric_relabel_configs:\n      - source_labels: [__name__]\n"
                     f"        regex: '{keep[name]}'\n        action: keep\n")
        return text

    jobs = "".join(job(name, port) for name, port in targets.items())
    config = work / "prometheus.yml"
    config.write_text(f"global:\n  scrape_interval: {interval_s}s\n  scrape_timeout: {interval_s}s\n"
                      f"scrape_configs:\n{jobs}")
    port = free_port()
    with process([binary, f"--config.file={config}", f"--storage.tsdb.path={work / 'prom-data'}",
                  f"--web.listen-address=127.0.0.1:{port}"], work / "prometheus.out") as proc:
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: http_ok(f"{base}/-/ready"), what="Prometheus ready", proc=proc)
        yield base
