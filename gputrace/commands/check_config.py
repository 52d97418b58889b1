"""`gputrace check-config FILE`: validate a gputrace.toml and summarise what it describes."""

from __future__ import annotations

import os

import click

from gputrace.config import load_config, ssh_target_text
from gputrace.errors import ConfigError


@click.command("check-config")
@click.argument("path", type=click.Path(dir_okay=True, path_type=str))
def command(path: str) -> None:
    """Validate a gputrace.toml and print the hosts, sources and topology it describes."""
    cfg = load_config(path)
    for i, h in enumerate(cfg.hosts):
        # a local log path can be looked at here (a remote one only by the collector's follower)
        if h.ssh is None and h.log is not None and h.log.kind == "file" and \
                os.path.isdir(os.path.expanduser(h.log.target)):
            raise ConfigError(f"{cfg.path}: hosts[{i}].log.path: {h.log.target} is a directory, "
                              "not a log file")
    topo = cfg.topology
    click.echo(f"{cfg.path}: ok")
    click.echo(f"  topology: pp={topo.pp_size} tp={topo.tp_size} dp={topo.dp_size} "
               f"nnodes={topo.nnodes}" + (f", {len(topo.placements)} explicit placements"
                                          if topo.placements else ""))
    for h in cfg.hosts:
        where = "local" if h.ssh is None else f"ssh {ssh_target_text(h.ssh)}"
        log = f"{h.log.kind} {h.log.target!r} ({h.log.engine})" if h.log else "no log source"
        click.echo(f"  host {h.name}: {where}; agent {h.agent or 'none'}; {log}")
        if h.ssh is None and h.log is not None and h.log.kind == "file" and \
                not os.path.exists(os.path.expanduser(h.log.target)):
            # not an error: the collector may start before the engine creates its log
            click.echo(f"  warning: host {h.name}: {h.log.target} does not exist (yet); the collector "
                       "waits for it, so check the path if the engine is already running")
    listed = [h for h in cfg.hosts if h.gpus is not None]
    need = topo.pp_size * topo.tp_size * topo.dp_size
    have = sum(len(h.gpus or ()) for h in listed)
    if listed and not topo.placements and len(listed) == len(cfg.hosts) and have < need:
        click.echo(f"  warning: the hosts list {have} GPUs, but pp x tp x dp = {topo.pp_size} x "
                   f"{topo.tp_size} x {topo.dp_size} = {need}: stages without a GPU get no busy figure "
                   "(list every host's GPUs, or give [[topology.map]])")
    if cfg.load:
        click.echo(f"  load: {cfg.load.url} C={','.join(map(str, cfg.load.concurrency))}")
