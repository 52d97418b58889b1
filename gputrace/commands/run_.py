"""`gputrace run`: collect while a benchmark runs (any command, or the built-in load), then report."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
from pathlib import Path

import click

from gputrace.collect import Collector, install_stop_signals, open_run_store
from gputrace.commands.collect import collect_flags, collect_options
from gputrace.config import Config, LoadConfig, load_config
from gputrace.errors import SourceError, StoreWriteError, UsageError
from gputrace.load.generator import LoadGenerator, LoadSpec, LoadSpecFields, load_prompts, spec_from_config
from gputrace.logsetup import get_logger

log = get_logger("run")


def load_spec_from(cfg: Config, url: str | None, model: str | None, concurrency: str | None,
                   max_tokens: int | None, requests_per_level: int | None,
                   duration_per_level: float | None, warmup: float | None,
                   stream: bool | None, prompts: str | None, drain: float | None = None,
                   ignore_eos: bool | None = None, burst: bool | None = None) -> LoadSpec:
    """The built-in load: the config's [load] table, overridden by flags."""
    if cfg.load is None and url is None:
        raise UsageError("nothing to run: give a command after `--`, a [load] table in the config, "
                         "or --url for the built-in load")
    base = cfg.load or LoadConfig(url=url or "")
    overrides: LoadSpecFields = {}  # a flag given wins over the table
    if url is not None:
        overrides["url"] = url
    if model is not None:
        overrides["model"] = model
    if max_tokens is not None:
        overrides["max_tokens"] = max_tokens
    if requests_per_level is not None:
        overrides["requests_per_level"] = requests_per_level
    if duration_per_level is not None:
        overrides["duration_per_level_s"] = duration_per_level
    if warmup is not None:
        overrides["warmup_s"] = warmup
    if stream is not None:
        overrides["stream"] = stream
    if drain is not None:
        overrides["drain_s"] = drain
    if ignore_eos is not None:
        overrides["ignore_eos"] = ignore_eos
    if burst is not None:
        overrides["burst"] = burst
    if concurrency:
        try:
            overrides["concurrency"] = tuple(int(c) for c in concurrency.split(","))
        except ValueError:
            raise UsageError(f"--concurrency {concurrency!r}: expected integers like 1,8,32,64") from None
    if prompts:
        overrides["prompts"] = load_prompts(prompts)
    spec = spec_from_config(base, **overrides)
    if spec.requests_per_level is None and spec.duration_per_level_s is None and not spec.burst:
        spec = dataclasses.replace(spec, duration_per_level_s=60.0)
    return spec


async def _run_command(argv: list[str], mark_url: str, stop: asyncio.Event) -> int:
    env = {**os.environ, "GPUTRACE_MARK_URL": mark_url}
    try:
        proc = await asyncio.create_subprocess_exec(*argv, env=env)
    except OSError as exc:
        raise SourceError(f"cannot start {argv[0]!r}: {exc.strerror}") from exc
    waiter = asyncio.create_task(proc.wait())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if not waiter.done():
        proc.send_signal(signal.SIGINT)  # pass the user's interrupt on, then wait for it
        await waiter
    stopper.cancel()
    return proc.returncode if proc.returncode is not None else 1


@click.command("run", context_settings={"ignore_unknown_options": False})
@collect_flags
@click.option("--url", default=None, help="Built-in load: the OpenAI-compatible server (overrides [load]).")
@click.option("--model", default=None, help="Built-in load: model name.")
@click.option("--concurrency", default=None, help="Built-in load: levels, e.g. 1,8,32,64.")
@click.option("--max-tokens", type=int, default=None, help="Built-in load: max_tokens per request.")
@click.option("--requests-per-level", type=int, default=None)
@click.option("--duration-per-level", type=float, default=None, help="Seconds per level.")
@click.option("--warmup", type=float, default=None,
              help="Built-in load: seconds of warm-up at the first level's concurrency, once, "
                   "before the sweep.")
@click.option("--stream/--no-stream", default=None)
@click.option("--drain", type=float, default=None,
              help="Built-in load: abandon requests still running this many seconds after the last level.")
@click.option("--prompts", type=click.Path(dir_okay=False), default=None, help="Prompts JSONL.")
@click.option("--ignore-eos/--no-ignore-eos", default=None,
              help="Built-in load: ask the server to always generate --max-tokens (overrides [load]).")
@click.option("--burst/--no-burst", default=None,
              help="Built-in load: each level's C requests at once, the level ends when the last is "
                   "back (overrides [load]).")
@click.option("--report/--no-report", "write_report", default=True, show_default=True,
              help="Write the bubble-diagnosis report when the run ends.")
@click.argument("cmd", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def command(ctx: click.Context, config_path: str, out: Path, listen: str, accept_new_host_keys: bool,
            insecure_skip_host_key_check: bool, agent_token_file: str | None, token_file: str | None,
            insecure: bool, url: str | None, model: str | None, concurrency: str | None,
            max_tokens: int | None, requests_per_level: int | None, duration_per_level: float | None,
            warmup: float | None, stream: bool | None, drain: float | None, prompts: str | None,
            ignore_eos: bool | None, burst: bool | None, write_report: bool,
            cmd: tuple[str, ...]) -> None:
    """Collect while CMD runs (`gputrace run --config F --out D -- CMD ARGS...`), or while the
    built-in load generator sweeps its concurrency levels; then write the report.

    CMD gets GPUTRACE_MARK_URL in its environment, so `gputrace mark C=64` inside it marks phases.
    """
    cfg = load_config(config_path)
    options = collect_options(listen, accept_new_host_keys, insecure_skip_host_key_check,
                              agent_token_file, token_file, insecure)
    if cmd and not options.listen:
        raise UsageError("a wrapped command needs the collector's --listen address for its marks")
    spec = None if cmd else load_spec_from(cfg, url, model, concurrency, max_tokens, requests_per_level,
                                           duration_per_level, warmup, stream, prompts, drain,
                                           ignore_eos, burst)
    exit_status = 0
    started = False
    lost: str | None = None

    async def main() -> None:
        nonlocal exit_status, started, lost
        with open_run_store(out, cfg) as store:
            collector = Collector(cfg, store, options)
            stop = asyncio.Event()
            install_stop_signals(stop)
            try:
                if not await collector.start_unless(stop):
                    return  # SIGINT/SIGTERM while starting: nothing to report
                started = True
                if cmd:
                    exit_status = await _run_command(list(cmd), f"{collector.url}/v1/mark", stop)
                else:
                    assert spec is not None
                    generator = LoadGenerator(spec, on_record=collector.add_load_record)
                    collector.attach_load(generator)
                    load_task = asyncio.create_task(generator.run())
                    stopper = asyncio.create_task(stop.wait())
                    await asyncio.wait({load_task, stopper}, return_when=asyncio.FIRST_COMPLETED)
                    stopper.cancel()
                    if not load_task.done():
                        load_task.cancel()
                    else:
                        load_task.result()
                await collector.drain()  # the last log lines and samples, into the store
            finally:
                await collector.stop()
                lost = collector.lost_on_stop

    asyncio.run(main())
    if lost is not None:  # the records not written are counted in meta.json; no report from less
        raise StoreWriteError(lost)
    click.echo(f"run written to {out}", err=True)
    if write_report and started:
        from gputrace.commands.report import command as report_command

        ctx.invoke(report_command, run=str(out), formats="html,md,json", out_dir=None, progress=None)
    if exit_status:
        raise SystemExit(exit_status)
