"""`gputrace collect`: capture a run (engine logs, agent samples, clock probes) until stopped."""

from __future__ import annotations

import asyncio
from pathlib import Path

import click

from gputrace.collect import DEFAULT_LISTEN, CollectOptions, Collector, install_stop_signals, open_run_store
from gputrace.config import load_config
from gputrace.errors import StoreWriteError
from gputrace.remote.connect import host_key_policy_from_flags
from gputrace.token_file import read_token


def collect_options(listen: str, accept_new: bool, insecure_skip: bool, agent_token_file: str | None,
                    token_file: str | None, insecure: bool) -> CollectOptions:
    return CollectOptions(listen=listen or None,
                          host_key_policy=host_key_policy_from_flags(accept_new, insecure_skip),
                          agent_token=read_token(agent_token_file, "--agent-token-file"),
                          http_token=read_token(token_file),
                          insecure=insecure)


def collect_flags(fn: click.decorators.FC) -> click.decorators.FC:
    """The flags `collect` and `run` share."""
    for option in reversed([
        click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False),
                     help="gputrace.toml describing hosts, log sources, agents and topology."),
        click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path),
                     help="New run directory to write."),
        click.option("--listen", default=DEFAULT_LISTEN, show_default=True,
                     help="Address for live /metrics, /v1/mark and /v1/status ('' for none)."),
        click.option("--accept-new-host-keys", is_flag=True,
                     help="Learn unknown SSH host keys into known_hosts (changed keys are still refused)."),
        click.option("--insecure-skip-host-key-check", is_flag=True,
                     help="Do not verify SSH host keys at all (logged loudly; never in production)."),
        click.option("--agent-token-file", type=click.Path(dir_okay=False), default=None,
                     help="Bearer token for agents that listen beyond loopback."),
        click.option("--token-file", type=click.Path(dir_okay=False), default=None,
                     help="Bearer token required by the collector's own HTTP endpoints."),
        click.option("--insecure", is_flag=True, help="Allow listening beyond loopback without a token."),
    ]):
        fn = option(fn)
    return fn


@click.command("collect")
@collect_flags
def command(config_path: str, out: Path, listen: str, accept_new_host_keys: bool,
            insecure_skip_host_key_check: bool, agent_token_file: str | None, token_file: str | None,
            insecure: bool) -> None:
    """Capture a run: follow each host's engine log, pull its agent's GPU samples, probe clocks.

    Writes to the run store at least every half second; SIGINT or SIGTERM stop it with everything
    flushed (exit 1 when the store could not take it all: what was not written is counted in
    meta.json). Phase markers can be posted to /v1/mark (see `gputrace mark`).
    """
    cfg = load_config(config_path)
    options = collect_options(listen, accept_new_host_keys, insecure_skip_host_key_check,
                              agent_token_file, token_file, insecure)

    async def main() -> str | None:
        with open_run_store(out, cfg) as store:
            collector = Collector(cfg, store, options)
            stop = asyncio.Event()
            install_stop_signals(stop)
            await collector.run_until(stop)
            return collector.lost_on_stop

    if (lost := asyncio.run(main())) is not None:
        raise StoreWriteError(lost)
    click.echo(f"run written to {out}", err=True)
