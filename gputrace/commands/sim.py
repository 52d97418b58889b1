"""`gputrace sim`: the PP serving simulator, in virtual time (a run store in seconds) or, with
`gputrace sim serve`, as a real-time OpenAI-compatible server for the demo."""

from __future__ import annotations

import time

import click

from gputrace.config import TomlValue
from gputrace.errors import UsageError
from gputrace.sim.params import SCENARIOS, load_params_file, parse_set_options

_SET_HELP = "Override a parameter (repeatable): --set pp_max_micro_batch_size=64."


def _overrides(params_file: str | None, sets: tuple[str, ...]) -> dict[str, TomlValue]:
    """Parameter overrides as written: the --params file's TOML values, then --set's strings."""
    values: dict[str, TomlValue] = load_params_file(params_file) if params_file else {}
    values.update(parse_set_options(sets))
    return values


@click.group("sim", invoke_without_command=True)
@click.option("--scenario", type=click.Choice(sorted(SCENARIOS)), help="The preset to run.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), help="Run store directory to write.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--log-out", type=click.Path(dir_okay=False), help="Also write the scheduler log here.")
@click.option("--gpu-csv", type=click.Path(dir_okay=False), help="Also write nvidia-smi CSV here.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help=_SET_HELP)
@click.option("--params", "params_file", type=click.Path(dir_okay=False), help="TOML file of overrides.")
@click.option("--list", "list_scenarios", is_flag=True, help="List the scenarios and exit.")
@click.pass_context
def command(ctx: click.Context, scenario: str | None, out_dir: str | None, seed: int,
            log_out: str | None, gpu_csv: str | None, sets: tuple[str, ...], params_file: str | None,
            list_scenarios: bool) -> None:
    """Simulate an SGLang pipeline-parallel deployment under a concurrency sweep, in virtual time.

    Writes a complete run store (GPU samples, scheduler log events, requests, phase markers,
    ground truth in meta.extra["ground_truth"]) in seconds. `gputrace sim serve` runs the same
    model in real time behind an OpenAI-compatible HTTP endpoint.
    """
    if ctx.invoked_subcommand is not None:
        return
    if list_scenarios:
        for s in SCENARIOS.values():
            click.echo(f"{s.name:18s} {s.summary}")
        return
    if scenario is None or out_dir is None:
        raise UsageError("gputrace sim needs --scenario and --out (or --list, or the serve subcommand)")
    from gputrace.sim.outputs import sample_columns, write_gpu_csv, write_log, write_store
    from gputrace.sim.virtual import run_scenario

    wall0 = time.perf_counter()
    result = run_scenario(scenario, seed, _overrides(params_file, sets))
    write_store(result, out_dir)
    if log_out:
        write_log(result, log_out)
    if gpu_csv:
        write_gpu_csv(result, gpu_csv, sample_columns(result))
    wall = time.perf_counter() - wall0
    click.echo(f"{out_dir}: {scenario} seed {seed}, {result.end_s:.0f} s simulated in {wall:.1f} s")
    for ph in result.ground_truth["phases"]:
        busy = [s["busy_fraction"] for s in ph["stages"]]
        click.echo(f"  {ph['label']:>6s}: {ph['throughput_tok_s']:8.1f} tok/s, busy "
                   f"{min(busy):.2f}-{max(busy):.2f}, causes: {', '.join(ph['causes']) or 'none'}")


@command.command("serve")
@click.option("--scenario", type=click.Choice(sorted(SCENARIOS)), default="motivating", show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=30000, show_default=True, help="0 picks a free port.")
@click.option("--log", "log_path", type=click.Path(dir_okay=False), required=True,
              help="Scheduler log file to write as the engine runs.")
@click.option("--gpu-feed", type=click.Path(dir_okay=False),
              help="Feed file for `gputrace agent --backend sim`.")
@click.option("--speed", type=float, default=1.0, show_default=True,
              help="Simulated seconds per wall second.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help=_SET_HELP)
@click.option("--params", "params_file", type=click.Path(dir_okay=False), help="TOML file of overrides.")
@click.option("--nnodes", type=int, default=1, show_default=True,
              help="Nodes the engine spans (SGLang's --nnodes); each runs its own `sim serve`.")
@click.option("--node-rank", type=int, default=0, show_default=True,
              help="This node (SGLang's --node-rank): 0 runs the engine and its HTTP endpoint, the "
                   "others write their ranks' log and GPU feed in their own clock.")
@click.option("--dist-init-addr", default=None, metavar="HOST:PORT",
              help="Where node 0 waits for the other nodes (SGLang's --dist-init-addr).")
def serve(scenario: str, host: str, port: int, log_path: str, gpu_feed: str | None, speed: float,
          seed: int, sets: tuple[str, ...], params_file: str | None, nnodes: int, node_rank: int,
          dist_init_addr: str | None) -> None:
    """Serve the simulated engine over OpenAI's HTTP API in (scaled) real time.

    Clients drive the load; the scheduler log goes to --log as the engine runs and the GPUs'
    busy intervals to --gpu-feed. Stop with Ctrl-C. Over several nodes (--nnodes), every node runs
    this command with its --node-rank and the same engine settings; each writes the log lines of
    the ranks SGLang places on it, and its GPUs' feed, stamped with its own clock.
    """
    from gputrace.sim.nodes import parse_dist_init_addr, real_time_lines, serve_node_forever
    from gputrace.sim.params import scenario_params
    from gputrace.sim.server import serve_forever

    if speed <= 0:
        raise UsageError("--speed must be > 0")
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise UsageError(f"--nnodes {nnodes} --node-rank {node_rank}: need nnodes >= 1 and "
                         f"0 <= node-rank < nnodes")
    if nnodes > 1 and dist_init_addr is None:
        raise UsageError("--nnodes > 1 needs --dist-init-addr HOST:PORT (where node 0 listens)")
    addr = parse_dist_init_addr(dist_init_addr) if dist_init_addr else None
    params = scenario_params(scenario, {**_overrides(params_file, sets), "seed": seed})
    real_time_lines(params)  # the engine's lines as it runs, or the one-line error
    if node_rank > 0:
        assert dist_init_addr is not None
        serve_node_forever(params, nnodes, node_rank, dist_init_addr, log_path, gpu_feed)
        return
    serve_forever(params, host=host, port=port, log_path=log_path, feed_path=gpu_feed, speed=speed,
                  announce=lambda url: click.echo(f"gputrace sim serve: {scenario} on {url}", err=True),
                  nnodes=nnodes, dist_init_addr=addr)
