"""The engine tier across two nodes: real SGLang's own multi-node launch on this machine's CPU
(`--nnodes 2 --node-rank 0|1 --dist-init-addr`, PP=2: one rank per node), each node a test host
(its own sshd on 127.0.0.N, its own clock: node1's whole engine runs 3.7 s ahead under
libfaketime), captured by `gputrace run` over SSH with the built-in load.

Asserted against the engine's own truth: every batch line each node's engine wrote is stored once,
under that node; node0's lines are PP0's and node1's PP1's, as SGLang places the ranks; the clock
offsets recovered within 5 ms of those set.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from engine_servers import (
    READY_LINES,
    EngineSetting,
    engine_command,
    engines_available,
    free_port,
    stop_process_group,
)
from live_chain import http_ok, wait_until
from testhosts import TestHost, gputrace_argv

from gputrace.store import Store

pytestmark = [pytest.mark.engine, pytest.mark.system, pytest.mark.slow]

OFFSETS_S = (0.0, 3.7)
TOLERANCE_NS = 5_000_000
READY_TIMEOUT_S = 480.0  # both nodes import SGLang and torch at once on shared cores
SGLANG_BATCH = re.compile(r"\] (?:Prefill|Decode) batch[,.]")
SGLANG_RANK = re.compile(r"^\[[^\]]*\bPP(\d+)\b[^\]]*\]")


@pytest.fixture
def two_node_sglang(test_hosts: Callable[[Sequence[float]], list[TestHost]]
                    ) -> Iterator[tuple[list[TestHost], str]]:
    """SGLang PP=2 over two test hosts (node r's engine under host r's clock); node 0's URL."""
    reason = engines_available()
    if reason is not None:
        if os.environ.get("GPUTRACE_REQUIRE_ENGINE_TESTS") == "1":
            pytest.fail(reason + "; GPUTRACE_REQUIRE_ENGINE_TESTS=1 makes this a failure")
        pytest.skip(reason)
    hosts = test_hosts(OFFSETS_S)
    port, dist_port = free_port(), free_port()
    argv, env = engine_command(EngineSetting("sglang", "default"), port)
    procs = []
    try:
        for rank, host in enumerate(hosts):
            node_argv = [a if a != "127.0.0.1" else host.address for a in argv]
            node_argv += ["--nnodes", "2", "--node-rank", str(rank),
                          "--dist-init-addr", f"{hosts[0].address}:{dist_port}"]
            # one rank per node, each on its own core
            node_env = {**env, **host.env, "SGLANG_CPU_OMP_THREADS_BIND": str(rank % (os.cpu_count() or 1))}
            with host.log_path.open("wb") as log_file:
                procs.append(subprocess.Popen(node_argv, stdout=log_file, stderr=subprocess.STDOUT,
                                              env=node_env, cwd=str(host.root), start_new_session=True))
        url = f"http://{hosts[0].address}:{port}"
        wait_until(lambda: http_ok(f"{url}/v1/models")
                   and READY_LINES["sglang"] in hosts[0].log_path.read_text(errors="replace"),
                   timeout_s=READY_TIMEOUT_S, what="SGLang node 0", proc=procs[0])
        yield hosts, url
    finally:
        for proc in reversed(procs):
            stop_process_group(proc)


def test_sglang_two_nodes_captured_over_two_test_hosts(
        tmp_path: Path, two_node_sglang: tuple[list[TestHost], str]) -> None:
    """Both nodes' logs followed over SSH: each batch line once under its node, PP0 on node0 and PP1
    on node1, and node1's 3.7 s recovered within 5 ms."""
    hosts, url = two_node_sglang
    cfg = tmp_path / "gputrace.toml"
    cfg.write_text("".join(h.host_toml(agent_port=None, node_rank=r) for r, h in enumerate(hosts))
                   + "[topology]\npp_size = 2\nnnodes = 2\n")
    run_dir = tmp_path / "run"
    out = subprocess.run(gputrace_argv("run", "--config", str(cfg), "--out", str(run_dir),
                                       "--listen", f"127.0.0.1:{free_port()}", "--url", url,
                                       "--concurrency", "1,4", "--duration-per-level", "10",
                                       "--max-tokens", "16", "--warmup", "0", "--no-report"),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    with Store.open(run_dir, read_only=True) as store:
        collector = store.meta.extra.get("collector")
        for rank, host in enumerate(hosts):
            written = [line for line in host.log_path.read_text(errors="replace").splitlines()
                       if SGLANG_BATCH.search(line)]
            ranks = {int(m.group(1)) for line in written if (m := SGLANG_RANK.match(line))}
            assert ranks == {rank}, (host.name, ranks)  # SGLang put PP rank r on node r
            n, distinct, stored_ranks = store.sql(
                "SELECT count(*), count(DISTINCT line_no), list(DISTINCT pp_rank) FROM scheduler_events "
                "WHERE host = ?", [host.name])[0]
            assert n == distinct == len(written), (host.name, n, distinct, len(written), collector,
                                                   out.stderr[-1500:])
            assert stored_ranks == [rank]
            probes = store.sql("SELECT remote_ns - (local_send_ns + local_recv_ns) // 2, "
                               "local_recv_ns - local_send_ns FROM clock_probes WHERE host = ?", [host.name])
            assert probes, host.name
            for offset_ns, rtt_ns in probes:
                error_ns = abs(offset_ns - host.offset_s * 1e9)
                assert error_ns < max(TOLERANCE_NS, rtt_ns / 2), (host.name, offset_ns, rtt_ns)
        assert store.count("requests") > 0
