"""End to end on this machine: the simulator's real-time server, an agent with the sim backend fed
by it, and `gputrace run` reaching both over SSH (a real sshd on 127.0.0.1) with the built-in
load. The store holds every stream, and the step from idle to load appears in all of them within
50 ms of each other once aligned."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from live_chain import free_port, http_ok, wait_until
from sshd import SshServer, sshd_server_fixture  # noqa: F401  (registers the sshd_server fixture)

from gputrace.analysis.aligned_run import align_store
from gputrace.store import Store

STEP_TOLERANCE_NS = 50_000_000


@pytest.fixture
def sim_and_agent(tmp_path: Path) -> Iterator[tuple[int, int, Path]]:
    """A real-time simulator (microbatch-cap) and an agent sampling its GPUs at 50 Hz."""
    log, feed = tmp_path / "sglang.log", tmp_path / "feed.ndjson"
    sim_port, agent_port = free_port(), free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "gputrace", "sim", "serve", "--scenario", "microbatch-cap",
         "--port", str(sim_port), "--log", str(log), "--gpu-feed", str(feed)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        wait_until(lambda: http_ok(f"http://127.0.0.1:{sim_port}/v1/models"))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "gputrace", "agent", "--backend", "sim", "--sim-feed", str(feed),
             "--listen", f"127.0.0.1:{agent_port}", "--interval", "0.02", "--host-name", "sim-node0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_until(lambda: http_ok(f"http://127.0.0.1:{agent_port}/healthz"))
        yield sim_port, agent_port, log
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(timeout=10)


def test_run_over_ssh_streams_agree_in_time(tmp_path: Path, sshd_server: SshServer,
                                            sim_and_agent: tuple[int, int, Path]) -> None:
    """GPU samples, per-stage scheduler events, requests and markers land in the store, and the
    start of the load shows in each stream within 50 ms of the phase marker."""
    sim_port, agent_port, log = sim_and_agent
    time.sleep(1.0)  # an idle second before the step
    cfg = tmp_path / "gputrace.toml"
    cfg.write_text(
        f'[[hosts]]\nname = "sim-node0"\nssh = "root@127.0.0.1:{sshd_server.port}"\n'
        f"identity_file = {json.dumps(str(sshd_server.client_key_path))}\n"
        f"known_hosts = {json.dumps(str(sshd_server.known_hosts_path))}\n"
        f'agent = "127.0.0.1:{agent_port}"\n\n'
        f'[hosts.log]\nkind = "file"\npath = {json.dumps(str(log))}\n\n[topology]\npp_size = 8\n')
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "gputrace", "run", "--config", str(cfg), "--out", str(run_dir),
         "--listen", f"127.0.0.1:{free_port()}", "--url", f"http://127.0.0.1:{sim_port}",
         "--concurrency", "8", "--duration-per-level", "4", "--max-tokens", "64", "--warmup", "0",
         "--no-report"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]

    with Store.open(run_dir, read_only=True) as store:
        stages = {r[0] for r in store.sql("SELECT DISTINCT pp_rank FROM scheduler_events")}
        assert stages == set(range(8))
        assert store.count("gpu_samples") > 0 and store.count("requests") > 0
        assert store.sql("SELECT label FROM markers WHERE kind = 'phase'") == [("C=8",)]
        assert store.sql("SELECT count(*) FROM clock_probes WHERE via = 'ssh'")[0][0] >= 1
        (step_ns,) = store.sql("SELECT ts_ns FROM markers WHERE kind = 'phase'")[0]
        (first_request_ns,) = store.sql("SELECT min(start_ns) FROM requests")[0]
        gpu = store.columns("gpu_samples", order_by="ts_ns")
        aligned = align_store(store)

    # The agent's per-tick records (every 20 ms) carry GPM SM activity over the tick; NVML's own
    # utilization samples come every 1/6 s, too coarse to time a step to 50 ms.
    ticks = (gpu["gpu_index"] == 0) & np.isnan(gpu["utilization_ratio"])
    ts, active = gpu["ts_ns"][ticks], gpu["sm_active_ratio"][ticks]
    period_ns = int(np.median(np.diff(ts)))
    busy = ts[(active > 0) & (ts > step_ns - 1_000_000_000)]
    first_gpu_ns = int(busy[0]) - period_ns // 2  # the first active tick window holds the step
    first_event_ns = min(int(ev.t_ns[0]) for ev in aligned.stage_events if len(ev.t_ns))
    offsets = {"request": first_request_ns - step_ns, "gpu": first_gpu_ns - step_ns,
               "log": first_event_ns - step_ns}
    print("step offsets from the marker, ms:", {k: round(v / 1e6, 1) for k, v in offsets.items()})
    assert all(abs(v) <= STEP_TOLERANCE_NS for v in offsets.values()), offsets
