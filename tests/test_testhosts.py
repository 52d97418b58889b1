"""The test hosts' clocks are really skewed: a session of each host's sshd (so the collector's
clock probe and log follower), the agent and the simulator node all read the host's offset, and
the collector's probes recover it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from live_chain import free_port, http_ok, wait_until
from testhosts import CLOCK_RELOAD_S, TestHost

from gputrace.agent.client import AgentClient
from gputrace.model import ClockProbe
from gputrace.remote.clock import probe_clock
from gputrace.remote.ssh import connect_ssh

pytestmark = pytest.mark.system

OFFSETS_S = (-1.2, 2.5)
TOLERANCE_NS = 5_000_000


async def best_agent_probe(agent: AgentClient, host: str) -> ClockProbe:
    """The agent's clock, best of 5 round trips (a busy machine stretches some)."""
    probes = [await agent.probe_clock(host) for _ in range(5)]
    return min(probes, key=lambda p: p.rtt_ns)


def test_host_processes_see_their_offset(test_hosts: Callable[[Sequence[float]], list[TestHost]]) -> None:
    """Python's time.time_ns() in a process of the host is off by the host's offset, and its
    time.sleep and monotonic clock work."""
    for host in test_hosts(OFFSETS_S):
        script = ("import time; m = time.monotonic(); time.sleep(0.05); "
                  "print(time.time_ns(), time.monotonic() - m)")
        before = time.time_ns()
        out = subprocess.run([sys.executable, "-c", script], env={**os.environ, **host.env},
                             capture_output=True, text=True, check=True).stdout.split()
        after = time.time_ns()
        seen_ns, slept_s = int(out[0]), float(out[1])
        assert before + host.offset_s * 1e9 <= seen_ns <= after + host.offset_s * 1e9
        assert 0.05 <= slept_s < 1.0


async def _probe_over_ssh(host: TestHost) -> Any:
    """The host's clock probed over a new SSH connection."""
    transport = await connect_ssh(host.sshd.options())
    try:
        return await probe_clock(transport, host.name)
    finally:
        await transport.close()


async def test_ssh_sessions_and_agents_report_the_hosts_clock(
        test_hosts: Callable[[Sequence[float]], list[TestHost]]) -> None:
    """Probes over each host's SSH (`date` in a session) and its agent's /v1/time (the agent
    under the host's clock) both recover the offset within 5 ms."""
    hosts = test_hosts(OFFSETS_S)
    ports = [free_port() for _ in hosts]
    for host, port in zip(hosts, ports, strict=True):
        host.spawn_agent(port, feed=False, gpus=2)
    for host, port in zip(hosts, ports, strict=True):
        await asyncio.to_thread(wait_until, lambda h=host, p=port: http_ok(f"http://{h.address}:{p}/healthz"))
        probe = await _probe_over_ssh(host)
        assert abs(probe.offset_ns - host.offset_s * 1e9) < TOLERANCE_NS, (host.name, probe)
        agent = AgentClient(f"http://{host.address}:{port}")
        try:
            agent_probe = await best_agent_probe(agent, host.name)
        finally:
            await agent.close()
        assert abs(agent_probe.offset_ns - host.offset_s * 1e9) < TOLERANCE_NS, (host.name, agent_probe)


async def test_a_hosts_clock_steps_for_all_its_processes(
        test_hosts: Callable[[Sequence[float]], list[TestHost]]) -> None:
    """set_offset moves the clock of the host's running processes (agent, SSH sessions) too."""
    (host,) = test_hosts((0.5,))
    port = free_port()
    host.spawn_agent(port, feed=False, gpus=1)
    await asyncio.to_thread(wait_until, lambda: http_ok(f"http://{host.address}:{port}/healthz"))
    agent = AgentClient(f"http://{host.address}:{port}")
    transport = await connect_ssh(host.sshd.options())
    try:
        host.set_offset(-0.25)
        await asyncio.sleep(CLOCK_RELOAD_S + 0.5)
        for probe in (await probe_clock(transport, host.name), await best_agent_probe(agent, host.name)):
            assert abs(probe.offset_ns + 0.25e9) < TOLERANCE_NS, probe
    finally:
        await transport.close()
        await agent.close()
