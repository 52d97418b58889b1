"""Clock-offset probes over a real SSH connection (the host is this machine, so the truth is 0)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from sshd import SshServer, sshd_server_fixture, wait_no_processes  # noqa: F401  (the sshd_server fixture)

from gputrace.model import ClockProbe
from gputrace.remote.clock import ClockProber, probe_clock, probe_clock_periodically
from gputrace.remote.local import LocalTransport
from gputrace.remote.ssh import connect_ssh

pytestmark = pytest.mark.system


def assert_causal(probe: ClockProbe) -> None:
    # Same clock on both ends: the host's reading lies inside the round trip, so |offset| <= rtt / 2.
    assert probe.local_send_ns <= probe.remote_ns <= probe.local_recv_ns
    assert abs(probe.offset_ns) <= probe.rtt_ns // 2 + 1


async def test_probe_over_ssh_brackets_the_host_time(sshd_server: SshServer) -> None:
    """A probe over SSH reads the host clock between send and receive, named after the host."""
    transport = await connect_ssh(sshd_server.options(), name="node0")
    try:
        probe = await probe_clock(transport, samples=5)
    finally:
        await transport.close()
    assert probe.host == "node0" and probe.via == "ssh"
    assert_causal(probe)
    assert 0 < probe.rtt_ns < 2_000_000_000


async def test_best_probe_has_the_smallest_round_trip(sshd_server: SshServer) -> None:
    """Of several probes on one channel, probe() keeps the one with the smallest round trip. (Each
    probe it takes is recorded and compared, not a separate set taken earlier: CI, session 12, saw
    the best of 6 at 1.39 ms against 1.35 ms for the median of 6 singles taken before it.)"""
    transport = await connect_ssh(sshd_server.options())
    prober = ClockProber(transport)
    taken: list[ClockProbe] = []
    real_once = prober._once

    async def recorded_once() -> ClockProbe:
        probe = await real_once()
        taken.append(probe)
        return probe

    prober._once = recorded_once  # type: ignore[method-assign]
    try:
        best = await prober.probe(samples=6)
    finally:
        await prober.close()
        await transport.close()
    assert len(taken) == 6
    for probe in taken:
        assert_causal(probe)
    assert best is min(taken, key=lambda p: p.rtt_ns)


async def test_periodic_probes_survive_a_lost_connection(sshd_server: SshServer) -> None:
    """Probes repeat during a run; a killed sshd session costs at most a round, then they continue."""
    transport = await connect_ssh(sshd_server.options())
    probes: list[ClockProbe] = []
    periodic = probe_clock_periodically(transport, interval_s=0.05, samples=3)
    try:
        async for probe in periodic:
            probes.append(probe)
            if len(probes) == 2:
                sshd_server.kill_sessions()
            if len(probes) == 5:
                break
    finally:
        await periodic.aclose()
        await transport.close()
    assert len(probes) == 5 and transport.connects >= 2
    for probe in probes:
        assert_causal(probe)
    assert [p.local_send_ns for p in probes] == sorted(p.local_send_ns for p in probes)
    assert wait_no_processes("date +%s%N") == []


async def test_local_probe(tmp_path: Path) -> None:
    """The local transport probes the same way (offset within half a round trip of 0)."""
    probe = await asyncio.wait_for(probe_clock(LocalTransport("here"), samples=3), timeout=10)
    assert probe.host == "here"
    assert_causal(probe)
