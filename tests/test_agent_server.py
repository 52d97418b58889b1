"""The agent's HTTP server on a real loopback aiohttp server with the simulated backend."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import structlog
from prometheus_client.parser import text_string_to_metric_families
from slow_clients import fd_limit_of, get_within, half_sent_requests, raise_own_fd_limit

from gputrace.agent.client import AgentClient
from gputrace.agent.server import Agent, AgentSettings
from gputrace.cli import main
from gputrace.commands.agent import parse_duration_s
from gputrace.errors import UsageError
from gputrace.gpu.simulated import SimulatedSampler
from gputrace.topology import single_node_placements

AgentFactory = Callable[..., Any]


@pytest.fixture
async def start_agent() -> AsyncIterator[AgentFactory]:
    """Starts agents on 127.0.0.1 with a random port; stops them after the test."""
    agents: list[Agent] = []

    async def start(gpus: int = 2, pattern: str = "constant:0.5", **settings: Any) -> Agent:
        sampler = SimulatedSampler("node-a", gpus, pattern=pattern)
        agent = Agent(sampler, AgentSettings(**{"port": 0, **settings}), host="node-a")
        agents.append(agent)
        await agent.start()
        return agent

    yield start
    for agent in agents:
        await agent.stop()


def _url(agent: Agent, path: str = "", scheme: str = "http") -> str:
    return f"{scheme}://127.0.0.1:{agent.port}{path}"


async def _get(url: str, **kw: Any) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.get(url, **kw) as resp:
        return resp.status, await resp.text()


def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


async def test_metrics_names_labels_and_values(start_agent: AgentFactory) -> None:
    """/metrics has the gputrace_* families with host/gpu/uuid/model labels and the sim's values."""
    agent = await start_agent(gpus=2, pattern="constant:0.5")
    agent.loop.tick()  # a second tick: the first one's window predates the pattern's steady state
    status, text = await _get(_url(agent, "/metrics"))
    assert status == 200
    fams = _families(text)
    expected = {"gputrace_gpu_utilization_ratio", "gputrace_gpu_memory_utilization_ratio",
                "gputrace_gpu_power_watts", "gputrace_gpu_energy_joules",
                "gputrace_gpu_pcie_tx_bytes_per_second",
                "gputrace_gpu_pcie_rx_bytes_per_second", "gputrace_gpu_sm_clock_hertz",
                "gputrace_gpu_memory_used_bytes", "gputrace_gpu_temperature_celsius",
                "gputrace_gpu_sm_active_ratio", "gputrace_agent_up", "gputrace_agent_scrape_duration_seconds"}
    assert expected <= fams.keys()
    assert not any(name.startswith("DCGM_") for name in fams)
    power = {s.labels["gpu"]: s for s in fams["gputrace_gpu_power_watts"].samples}
    assert set(power) == {"0", "1"}
    devices = {d.gpu_index: d for d in agent.devices}
    for gpu, sample in power.items():
        d = devices[int(gpu)]
        assert sample.labels == {"host": "node-a", "gpu": gpu, "uuid": d.uuid, "model": d.name}
        assert d.power_limit_w is not None
        assert sample.value == pytest.approx(70.0 + 0.5 * (d.power_limit_w - 70.0), abs=0.01)
    util = {s.labels["gpu"]: s.value for s in fams["gputrace_gpu_utilization_ratio"].samples}
    assert util == {"0": 0.5, "1": 0.5}
    energy = fams["gputrace_gpu_energy_joules"]
    assert energy.type == "counter" and all(s.name.endswith("_total") and s.value > 0 for s in energy.samples)
    assert fams["gputrace_agent_up"].samples[0].value == 1.0


async def test_topology_adds_pp_and_tp_rank_labels(start_agent: AgentFactory) -> None:
    """With a topology every GPU series carries its pp_rank and tp_rank."""
    agent = await start_agent(gpus=4, placements=single_node_placements("node-a", 2, 2))
    _, text = await _get(_url(agent, "/metrics"))
    ranks = {(s.labels["gpu"], s.labels["pp_rank"], s.labels["tp_rank"])
             for s in _families(text)["gputrace_gpu_power_watts"].samples}
    assert ranks == {("0", "0", "0"), ("1", "0", "1"), ("2", "1", "0"), ("3", "1", "1")}


async def test_dcgm_compat_names_labels_and_units(start_agent: AgentFactory) -> None:
    """--dcgm-compat adds DCGM-exporter names, labels and units (percent, W, MHz, MiB)."""
    agent = await start_agent(gpus=2, pattern="constant:0.5", dcgm_compat=True)
    agent.loop.tick()
    _, text = await _get(_url(agent, "/metrics"))
    fams = _families(text)
    for name in ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_PROF_PCIE_TX_BYTES",
                 "DCGM_FI_PROF_PCIE_RX_BYTES", "DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_FB_USED",
                 "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_PROF_SM_ACTIVE", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"):
        assert name in fams, name
    util = {s.labels["gpu"]: s for s in fams["DCGM_FI_DEV_GPU_UTIL"].samples}
    d0 = agent.devices[0]
    assert util["0"].labels == {"gpu": "0", "UUID": d0.uuid, "pci_bus_id": d0.pci_bus_id,
                                "device": "nvidia0", "modelName": d0.name, "Hostname": "node-a"}
    assert util["0"].value == 50.0
    ours = {s.labels["gpu"]: s.value for s in fams["gputrace_gpu_sm_clock_hertz"].samples}
    dcgm = {s.labels["gpu"]: s.value for s in fams["DCGM_FI_DEV_SM_CLOCK"].samples}
    assert {g: v / 1e6 for g, v in ours.items()} == dcgm
    used = {s.labels["gpu"]: s.value for s in fams["gputrace_gpu_memory_used_bytes"].samples}
    assert {g: v / 2**20 for g, v in used.items()} == {
        s.labels["gpu"]: s.value for s in fams["DCGM_FI_DEV_FB_USED"].samples}


async def test_paging_100_pages_at_100_hz_no_gap_no_duplicate(start_agent: AgentFactory) -> None:
    """While sampling at 100 Hz, 100 pages of /v1/samples give every seq exactly once, in order."""
    agent = await start_agent(gpus=8, pattern="square:0.5", interval_s=0.01)
    client = AgentClient(_url(agent), page_limit=25)
    seqs: list[int] = []
    last_tick: dict[int, int] = {}
    try:
        for _ in range(100):
            while agent.ring.newest_seq < client.since + 25:  # let a full page accumulate
                await asyncio.sleep(0.005)
            for s in await client.fetch_page():
                assert s.seq is not None
                seqs.append(s.seq)
                if s.power_w is not None:  # tick records of one GPU come in time order
                    assert s.ts_ns > last_tick.get(s.gpu_index, 0)
                    last_tick[s.gpu_index] = s.ts_ns
    finally:
        await client.close()
    assert client.stats.pages == 100
    assert seqs == list(range(1, len(seqs) + 1))
    assert len(seqs) == 100 * 25
    assert client.stats.gaps == 0 and agent.loop.stats.ticks > 2500 // (8 + 2)


async def test_cursor_older_than_ring_gets_410_with_oldest_seq(start_agent: AgentFactory) -> None:
    """A cursor that fell out of the ring gets 410 and the oldest seq still held."""
    agent = await start_agent(gpus=2, interval_s=0.01, buffer_s=0.05)
    for _ in range(200):
        if agent.ring.oldest_seq() > 5:
            break
        await asyncio.sleep(0.01)
    oldest = agent.ring.oldest_seq()
    assert oldest > 5
    status, body = await _get(_url(agent, "/v1/samples?since=1"))
    assert status == 410 and json.loads(body)["oldest_seq"] >= oldest
    # re-asked from the oldest seq the 410 names, as the client does: a sample or two may expire
    # before the request is served (the ring holds 50 ms; a worker on shared cores took longer),
    # each answer then names the new oldest, and a re-ask gets the page
    for _ in range(20):
        since = json.loads(body)["oldest_seq"] - 1
        status, body = await _get(_url(agent, f"/v1/samples?since={since}&limit=2"))
        if status != 410:
            break
    assert status == 200 and len(body.splitlines()) == 2


@pytest.mark.parametrize("query", ["since=abc", "since=-1", "limit=0", "limit=10001", "limit=1.5"])
async def test_bad_parameters_get_400(start_agent: AgentFactory, query: str) -> None:
    """Non-integer or out-of-range since/limit is a 400 with a JSON error."""
    agent = await start_agent()
    status, body = await _get(_url(agent, f"/v1/samples?{query}"))
    assert status == 400 and "error" in json.loads(body)


async def test_token_required_when_configured(start_agent: AgentFactory) -> None:
    """With a token, requests without it or with a wrong one get 401; /healthz stays open."""
    agent = await start_agent(token="s3cret-token")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-token"}):
        for path in ("/metrics", "/v1/samples", "/v1/time", "/v1/info"):
            status, _ = await _get(_url(agent, path), headers=headers)
            assert status == 401, (path, headers)
    status, _ = await _get(_url(agent, "/metrics"), headers={"Authorization": "Bearer s3cret-token"})
    assert status == 200
    assert (await _get(_url(agent, "/healthz")))[0] == 200
    client = AgentClient(_url(agent), token="s3cret-token")
    try:
        assert await client.fetch_page()
    finally:
        await client.close()


def test_refuses_non_loopback_without_token() -> None:
    """Listening beyond loopback without a token (or --insecure) is refused before sampling."""
    sampler = SimulatedSampler("node-a", 1)
    with pytest.raises(UsageError, match=r"refusing to listen on 0\.0\.0\.0"):
        Agent(sampler, AgentSettings(listen_host="0.0.0.0", port=0), host="node-a")
    Agent(sampler, AgentSettings(listen_host="0.0.0.0", port=0, insecure=True), host="node-a")
    Agent(sampler, AgentSettings(listen_host="0.0.0.0", port=0, token="t"), host="node-a")
    Agent(sampler, AgentSettings(listen_host="::1", port=0), host="node-a")


def test_cli_refuses_non_loopback_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """`gputrace agent --listen 0.0.0.0:PORT` without a token exits 2 with one error line."""
    try:
        with pytest.raises(SystemExit) as info:
            main(["agent", "--backend", "sim", "--listen", "0.0.0.0:0"])
    finally:
        structlog.reset_defaults()
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "gputrace: error: refusing to listen on 0.0.0.0 (not loopback) without --token-file; "
        "pass --insecure to expose the agent without authentication"]


@pytest.mark.parametrize("buffer", ["0s", "0", "500ms", "9s"])
def test_cli_refuses_a_buffer_too_short_to_keep_samples(buffer: str) -> None:
    """`agent --buffer 0s` started and answered every pull 410 forever: a ring shorter than the
    collector's longest retry (10 s) is one error line at start, exit 2."""
    proc = subprocess.run([sys.executable, "-m", "gputrace", "agent", "--backend", "sim", "--listen",
                           "127.0.0.1:0", "--buffer", buffer], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    shown = f"{parse_duration_s(buffer):g}s"
    assert proc.stderr.splitlines() == [
        f"gputrace: error: --buffer {shown}: must be at least 10s (the ring must keep samples until "
        "the collector's next try, at most 10 s later)"]


async def test_time_info_and_health(start_agent: AgentFactory) -> None:
    """/v1/time gives the agent clock, /v1/info the devices and backend, /healthz ok."""
    agent = await start_agent(gpus=3)
    client = AgentClient(_url(agent))
    try:
        probe = await client.probe_clock()
        info = await client.info()
    finally:
        await client.close()
    assert probe.via == "agent" and probe.host == "node-a"
    assert probe.local_send_ns <= probe.remote_ns <= probe.local_recv_ns  # same host, same clock
    assert info["backend"] == "sim" and [d["gpu_index"] for d in info["devices"]] == [0, 1, 2]
    assert {"driver_version", "nvml_version", "instance"} <= info.keys()
    status, body = await _get(_url(agent, "/healthz"))
    assert status == 200 and json.loads(body)["status"] == "ok"


async def test_tls(start_agent: AgentFactory, tmp_path: Path) -> None:
    """With --tls-cert/--tls-key the agent serves HTTPS that a client trusting the cert can read."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("needs openssl to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    agent = await start_agent(tls_cert=str(cert), tls_key=str(key))
    ctx = ssl.create_default_context(cafile=str(cert))
    client = AgentClient(_url(agent, scheme="https"), ssl_context=ctx)
    try:
        assert await client.fetch_page()
    finally:
        await client.close()
    with pytest.raises(aiohttp.ClientConnectorCertificateError):
        await _get(_url(agent, "/healthz", scheme="https"))


async def test_cli_agent_serves_and_stops_on_sigterm() -> None:
    """`gputrace agent --backend sim` serves /metrics on the logged port and exits 0 on SIGTERM."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gputrace", "--log-format", "json", "agent", "--backend", "sim",
        "--listen", "127.0.0.1:0", "--sim-gpus", "2", "--host-name", "cli-node", "--topology", "pp=2",
        stderr=asyncio.subprocess.PIPE)
    assert proc.stderr is not None
    try:
        url = None
        while url is None:
            line = await asyncio.wait_for(proc.stderr.readline(), timeout=30)
            assert line, "agent exited before listening"
            event = json.loads(line)
            if event.get("event") == "agent listening":
                url = event["url"]
        status, text = await _get(url + "/metrics")
        assert status == 200
        ranks = {(s.labels["host"], s.labels["gpu"], s.labels["pp_rank"])
                 for s in _families(text)["gputrace_gpu_power_watts"].samples}
        assert ranks == {("cli-node", "0", "0"), ("cli-node", "1", "1")}
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.wait_for(proc.wait(), timeout=15)
    assert rc == 0


MALFORMED_REQUESTS = (
    b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    b"GET /metrics HTTP/9.9\r\n\r\n",
    b"GET /\x00 HTTP/1.1\r\n\r\n",
    b"GET /metrics HTTP/1.1\r\nBad Header\r\n\r\n",
    b"GET /v1/samples HTTP/1.1\r\nAuthorization: Bearer \xff\xfe\r\n\r\n",
    b"GET /v1/samples?since=%ff HTTP/1.1\r\nAuthorization: \x00\r\n\r\n",
    b"GARBAGE\r\n\r\n",
    b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03",
)


def _status_of(port: int, raw: bytes) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(raw)
        head = sock.recv(4096)
    return int(head.split(b" ", 2)[1])


def test_malformed_requests_are_answered_400_and_logged_without_tracebacks(tmp_path: Path) -> None:
    """1,000 malformed unauthenticated requests logged a traceback each (520 KB in 0.41 s): each is
    answered 400 (never 500), the log holds one rate-limited line for them and no traceback, and
    a whole authorised request is answered after."""
    token = tmp_path / "token"
    token.write_text("sekrit\n")
    token.chmod(0o600)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gputrace", "--log-format", "json", "agent", "--backend", "sim",
         "--listen", "127.0.0.1:0", "--sim-gpus", "1", "--token-file", str(token)],
        stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    try:
        port = None
        while port is None:
            line = proc.stderr.readline()
            assert line, "agent exited before listening"
            if (event := json.loads(line)).get("event") == "agent listening":
                port = int(event["url"].rsplit(":", 1)[1])
        statuses = {_status_of(port, MALFORMED_REQUESTS[i % len(MALFORMED_REQUESTS)]) for i in range(1000)}
        assert statuses == {400}
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET /v1/info HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer sekrit\r\n"
                         b"Connection: close\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    finally:
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=15)
    assert proc.returncode == 0
    assert "Traceback" not in rest and len(rest) < 2000, rest[:3000]
    (bad,) = [json.loads(line) for line in rest.splitlines() if "malformed requests" in line]
    assert bad["event"] == "malformed requests answered 400" and bad["server"] == "agent"


def test_under_1024_files_1100_half_sent_requests_leave_healthz_answering() -> None:
    """Must show 3 of [robust] #15: an agent held to 1,024 open files, 1,100 connections that send
    half a request header and then nothing; a whole /healthz is answered within 1 s and the log
    holds one line about it (before: no answer in 5 s, 16,892 'Too many open files' tracebacks)."""
    raise_own_fd_limit(1100 + 100)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gputrace", "--log-format", "json", "agent", "--backend", "sim",
         "--listen", "127.0.0.1:0", "--sim-gpus", "2"],
        stderr=subprocess.PIPE, text=True, preexec_fn=fd_limit_of(1024))
    assert proc.stderr is not None
    try:
        port = None
        while port is None:
            line = proc.stderr.readline()
            assert line, "agent exited before listening"
            if (event := json.loads(line)).get("event") == "agent listening":
                port = int(event["url"].rsplit(":", 1)[1])
        with half_sent_requests(port, 1100):
            status, _ = get_within(port, "/healthz", timeout_s=1.0)
            assert status == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-2000:]
    events = [json.loads(line)["event"] for line in err.splitlines()]
    assert events == ["connections at the cap: closing the oldest idle ones"], err[-2000:]


async def test_healthz_answers_while_full_pages_are_encoded(start_agent: AgentFactory) -> None:
    """Ten 10,000-row pages asked first do not hold /healthz: it is answered before most of them
    (their encoding ran on the event loop, one after the other: /healthz waited seconds)."""
    agent = await start_agent(gpus=8, buffer_s=3600.0)
    t_ns = time.time_ns() - 20_000 * 100_000_000
    while len(agent.ring) < 100_000:
        agent.ring.extend(agent.sampler.sample_rows(t_ns), t_ns)
        t_ns += 100_000_000
    answered: list[str] = []  # in the order the answers' headers came
    async with aiohttp.ClientSession() as session:
        async def page(since: int) -> int:
            async with session.get(_url(agent, "/v1/samples"), params={"since": since, "limit": 10_000}) as r:
                answered.append("page")
                return len((await r.read()).splitlines())

        pages = [asyncio.create_task(page(since)) for since in range(0, 100_000, 10_000)]
        await asyncio.sleep(0.05)  # every page request sent
        async with session.get(_url(agent, "/healthz")) as resp:
            answered.append("healthz")
            assert resp.status == 200
        assert await asyncio.gather(*pages) == [10_000] * 10
    assert answered.index("healthz") < 5, answered


def test_healthz_stays_answered_while_10_clients_pull_full_pages() -> None:
    """[robust] #12 as described: an agent with a 115,000-sample ring, 10 clients in another process
    pulling /v1/samples?limit=10000 as fast as they are answered, /healthz asked every 10 ms for
    3 s (bench/agent_healthz.py): the median /healthz under 50 ms (before: p50 2.1 s, p99 3.1 s, each
    probe queued behind a page). The p99 is the bench's figure, not asserted: on these 2 shared cores
    the idle agent's own p99 reached 20 ms and the loaded one 52 ms, a scheduler tail, not a queue."""
    import re

    bench = Path(__file__).resolve().parent.parent / "bench" / "agent_healthz.py"
    out = subprocess.run([sys.executable, str(bench), "--fill", "115000", "--clients", "10", "--seconds", "3",
                          "--lookup-fill", "115000"], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = re.search(r"/healthz, 10 clients paging +n= *(\d+) +p50 +([\d.]+) ms +p99 +([\d.]+) ms",
                       out.stdout)
    assert loaded is not None, out.stdout
    answered = re.search(r"\(([\d.]+) pages/s answered\)", out.stdout)
    assert answered is not None and float(answered.group(1)) > 0  # the clients were paging
    n, p50_ms = int(loaded.group(1)), float(loaded.group(2))
    assert n >= 100 and p50_ms < 50.0, out.stdout
