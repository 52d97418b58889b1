"""`gputrace watch`: the live terminal view of a running capture."""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

import aiohttp
import click

from gputrace.collect import DEFAULT_LISTEN, CollectOptions, Collector, open_run_store
from gputrace.config import load_config
from gputrace.errors import SourceError, UsageError
from gputrace.vocabulary import LiveStatus
from gputrace.watch import watch


@click.command("watch")
@click.option("--collector", "collector_url", default=f"http://{DEFAULT_LISTEN}", show_default=True,
              help="A running collector (`gputrace collect` or `gputrace run`) to watch.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="Watch the hosts of a gputrace.toml directly, without a separate collector.")
@click.option("--refresh", type=float, default=0.3, show_default=True, help="Seconds between redraws.")
def command(collector_url: str, config_path: str | None, refresh: float) -> None:
    """Show the engine's running total, queue and micro-batches in flight, then one row per
    pipeline stage: its micro-batch, busy and bubble (and the signal they come from), power, PCIe,
    tok/s; what the figures say now in one line; the header turns red when the data is stale.
    `q` or Ctrl-C quits."""
    if not sys.stdout.isatty():
        # a live view redrawn in place means nothing in a pipe or a file (it printed nothing and
        # ran until killed)
        raise UsageError(f"watch draws a live view and needs a terminal; without one, read "
                         f"{collector_url.rstrip('/')}/v1/status (JSON) or the collector's /metrics")
    if config_path:
        asyncio.run(_watch_config(config_path, refresh))
    else:
        asyncio.run(_watch_url(collector_url.rstrip("/"), refresh))


async def read_status(session: aiohttp.ClientSession, url: str) -> LiveStatus:
    """The collector's /v1/status at ``url``; SourceError where it cannot be read or is no status."""
    try:
        async with session.get(f"{url}/v1/status") as resp:
            resp.raise_for_status()
            body = await resp.json()
    except aiohttp.ClientError as exc:
        raise SourceError(f"{url}: {exc}") from exc
    if not isinstance(body, dict):  # a status is one object: anything else is not a collector
        raise SourceError(f"{url}/v1/status: not a collector's status (a JSON object)")
    return LiveStatus.from_dict(body)


async def _watch_url(url: str, refresh: float) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        async def status() -> LiveStatus:
            return await read_status(session, url)
        await watch(status, refresh)


async def _watch_config(path: str, refresh: float) -> None:
    cfg = load_config(path)
    with tempfile.TemporaryDirectory(prefix="gputrace-watch-") as tmp, \
            open_run_store(Path(tmp) / "run", cfg) as store:
        collector = Collector(cfg, store, CollectOptions(listen=None, log_from_start=False))
        await collector.start()
        try:
            async def status() -> LiveStatus:
                return collector.status()
            await watch(status, refresh)
        finally:
            await collector.stop()
