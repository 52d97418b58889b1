"""`gputrace agent`: sample this host's GPUs and serve /metrics and /v1/samples."""

from __future__ import annotations

import asyncio
import re
import signal
import socket

import click

from gputrace.agent.server import DEFAULT_PORT, Agent, AgentSettings, check_exposure
from gputrace.errors import UsageError
from gputrace.gpu.sampler import Sampler
from gputrace.httpserver import parse_listen
from gputrace.logsetup import get_logger
from gputrace.token_file import read_token
from gputrace.topology import Placement, sglang_placements

log = get_logger("agent")


def parse_duration_s(text: str) -> float:
    """``15m``, ``900s``, ``1h``, ``90`` (seconds) -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*", text)
    if not m:
        raise UsageError(f"--buffer {text!r}: expected a duration like 15m, 900s or 1h")
    return float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[m.group(2) or "s"]


# The collector asks an agent that stopped answering again at most every 10 s (AgentClient.follow's
# retry_max_s): a ring shorter than that has dropped what it missed (--buffer 0s answered 410 forever).
MIN_BUFFER_S = 10.0


def check_buffer(buffer_s: float, interval_s: float) -> None:
    """A ring that keeps samples across a collector's retry and holds at least two ticks."""
    least = max(MIN_BUFFER_S, 2 * interval_s)
    if buffer_s < least:
        raise UsageError(f"--buffer {buffer_s:g}s: must be at least {least:g}s (the ring must keep "
                         "samples until the collector's next try, at most 10 s later)")


def parse_topology(text: str, host: str) -> list[Placement]:
    """``pp=8,tp=1[,nnodes=N,node_rank=R,base_gpu_id=B]`` -> the placements of this host's GPUs."""
    keys = {"pp": 1, "tp": 1, "nnodes": 1, "node_rank": 0, "base_gpu_id": 0, "gpu_id_step": 1}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        if key not in keys or not value.isdigit():
            raise UsageError(f"--topology {text!r}: expected pp=N,tp=N (optional nnodes, node_rank, "
                             f"base_gpu_id, gpu_id_step), got {part!r}")
        keys[key] = int(value)
    return sglang_placements(host, pp_size=keys["pp"], tp_size=keys["tp"], nnodes=keys["nnodes"],
                             node_rank=keys["node_rank"], base_gpu_id=keys["base_gpu_id"],
                             gpu_id_step=keys["gpu_id_step"])


def _make_sampler(backend: str, host: str | None, sim_gpus: int, sim_feed: str | None,
                  sim_pattern: str) -> Sampler:
    if backend == "nvml":
        from gputrace.gpu.nvml import NvmlSampler

        return NvmlSampler(host)
    from gputrace.gpu.simulated import SimulatedSampler

    return SimulatedSampler(host, sim_gpus, pattern=sim_pattern, feed_path=sim_feed)


async def _serve(agent: Agent) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    port = await agent.start()
    scheme = "https" if agent.settings.tls_cert else "http"
    log.info("agent listening", url=f"{scheme}://{agent.settings.listen_host}:{port}",
             backend=agent.sampler.backend, gpus=len(agent.devices), host=agent.host,
             interval_s=agent.settings.interval_s, auth="token" if agent.settings.token else "none")
    try:
        await stop.wait()
    finally:
        await agent.stop()


@click.command("agent")
@click.option("--listen", default=f"127.0.0.1:{DEFAULT_PORT}", show_default=True,
              help="HOST:PORT to serve on; beyond loopback needs --token-file or --insecure.")
@click.option("--interval", type=float, default=0.1, show_default=True, help="Seconds between samples.")
@click.option("--buffer", "buffer_", default="15m", show_default=True,
              help="How much history /v1/samples keeps (e.g. 15m, 900s).")
@click.option("--backend", type=click.Choice(["nvml", "sim"]), default="nvml", show_default=True)
@click.option("--sim-feed", type=click.Path(dir_okay=False), default=None,
              help="Simulator feed file to tail (with --backend sim).")
@click.option("--sim-gpus", type=int, default=8, show_default=True, help="GPUs to simulate without a feed.")
@click.option("--sim-pattern", default="square", show_default=True,
              help="square[:PERIOD_S[:DUTY]], constant[:LEVEL] or idle (sim without a feed).")
@click.option("--host-name", default=None, help="Host label on samples and metrics (default: hostname).")
@click.option("--topology", default=None, help="pp=8,tp=1: adds pp_rank/tp_rank labels (SGLang placement).")
@click.option("--token-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="File holding the bearer token clients must send.")
@click.option("--tls-cert", type=click.Path(exists=True, dir_okay=False), default=None)
@click.option("--tls-key", type=click.Path(exists=True, dir_okay=False), default=None)
@click.option("--insecure", is_flag=True, help="Allow a non-loopback address without a token.")
@click.option("--dcgm-compat", is_flag=True, help="Also export DCGM-exporter metric names and labels.")
@click.option("--dcgm-schema", type=click.Choice(["4.8", "4.9", "4.10"]), default="4.8", show_default=True,
              help="Which dcgm-exporter's names and units --dcgm-compat serves: 4.8 (every release before "
                   "4.9: %, MHz, mJ, MiB), 4.9 (DCGM 4.7 names: ratios, Hz, J, bytes), 4.10 (PCIe/NVLink "
                   "*_PER_SECOND).")
def command(listen: str, interval: float, buffer_: str, backend: str, sim_feed: str | None,
            sim_gpus: int, sim_pattern: str, host_name: str | None, topology: str | None,
            token_file: str | None, tls_cert: str | None, tls_key: str | None, insecure: bool,
            dcgm_compat: bool, dcgm_schema: str) -> None:
    """Sample this host's GPUs (NVML, or simulated) and serve /metrics, /v1/samples, /v1/time,
    /v1/info and /healthz."""
    host, port = parse_listen(listen)
    if not 0.001 <= interval <= 60:
        raise UsageError("--interval must be between 0.001 and 60 seconds")
    if sim_feed and backend != "sim":
        raise UsageError("--sim-feed needs --backend sim")
    buffer_s = parse_duration_s(buffer_)
    check_buffer(buffer_s, interval)
    token = read_token(token_file)
    settings = AgentSettings(listen_host=host, port=port, interval_s=interval,
                             buffer_s=buffer_s, token=token, insecure=insecure,
                             tls_cert=tls_cert, tls_key=tls_key, dcgm_compat=dcgm_compat,
                             dcgm_schema=dcgm_schema,
                             placements=parse_topology(topology, host_name or socket.gethostname())
                             if topology else None)
    check_exposure(settings)  # before touching NVML: a refused start should not wait on the driver
    sampler = _make_sampler(backend, host_name, sim_gpus, sim_feed, sim_pattern)
    agent = Agent(sampler, settings, host=getattr(sampler, "host", host_name or "localhost"))
    asyncio.run(_serve(agent))
