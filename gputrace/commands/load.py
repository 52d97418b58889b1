"""`gputrace load`: drive an OpenAI-compatible endpoint through a concurrency sweep."""

from __future__ import annotations

import asyncio
import os

import click
from rich.console import Console

from gputrace.errors import SourceError, UsageError
from gputrace.imports.jsonl import JsonlWriter
from gputrace.load.console import failure_reasons, print_summary, run_with_progress
from gputrace.load.generator import DEFAULT_PROMPTS, LoadGenerator, LoadResult, LoadSpec, load_prompts


def _levels(value: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise UsageError(f"--concurrency: expected a list like 1,8,32,64, got {value!r}") from None
    if not levels:
        raise UsageError("--concurrency: no levels given")
    return levels


@click.command("load")
@click.option("--url", required=True, help="Server base URL, e.g. http://127.0.0.1:30000.")
@click.option("--model", required=True, help="Model name sent in each request.")
@click.option("--concurrency", default="1,8,32,64", show_default=True,
              help="Comma-separated levels: requests kept in flight.")
@click.option("--max-tokens", type=int, default=512, show_default=True)
@click.option("--requests-per-level", type=int, default=None,
              help="Requests issued per level (default 4 x C).")
@click.option("--duration-per-level", type=float, default=None, help="Seconds per level.")
@click.option("--warmup", type=float, default=0.0, show_default=True,
              help="Seconds of warm-up at the first level's concurrency before the sweep.")
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False), default=None,
              help="JSONL with one {'prompt': ...} or {'messages': [...]} per line.")
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--stream/--no-stream", default=True, show_default=True)
@click.option("--ignore-eos", is_flag=True, help="Ask the server to always generate --max-tokens.")
@click.option("--burst", is_flag=True,
              help="Each level sends its C requests at once and ends when the last one is back "
                   "(no replacements): throughput is all tokens over that wall time.")
@click.option("--drain", type=float, default=None,
              help="After the last level, abandon requests still running after this many seconds "
                   "[default: wait for them].")
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="Write every request and marker as JSON lines here.")
@click.option("--mark-url", default=None,
              help="POST each phase marker here (default: $GPUTRACE_MARK_URL).")
@click.option("--host", default=None, help="Host name recorded with the requests (default: this host).")
def command(
    url: str,
    model: str,
    concurrency: str,
    max_tokens: int,
    requests_per_level: int | None,
    duration_per_level: float | None,
    warmup: float,
    prompts_file: str | None,
    temperature: float,
    stream: bool,
    ignore_eos: bool,
    burst: bool,
    drain: float | None,
    out: str | None,
    mark_url: str | None,
    host: str | None,
) -> None:
    """Keep exactly C requests in flight per level (or, with --burst, send C at once per level) and
    report what each level achieved.

    Prints a per-level table (aggregate and per-request tok/s, TTFT and ITL percentiles, ok/failed,
    the in-flight count actually kept) and warns when the client fell short of C.
    """
    spec_kwargs: dict[str, object] = {}
    if host:
        spec_kwargs["host"] = host
    spec = LoadSpec(
        url=url,
        model=model,
        concurrency=_levels(concurrency),
        max_tokens=max_tokens,
        requests_per_level=requests_per_level,
        duration_per_level_s=duration_per_level,
        warmup_s=warmup,
        prompts=load_prompts(prompts_file) if prompts_file else DEFAULT_PROMPTS,
        temperature=temperature,
        stream=stream,
        ignore_eos=ignore_eos,
        burst=burst,
        drain_s=drain,
        mark_url=mark_url or os.environ.get("GPUTRACE_MARK_URL") or None,
        **spec_kwargs,  # type: ignore[arg-type]
    )
    # Records go to --out as they finish, so an interrupted sweep keeps what it measured.
    writer = JsonlWriter(out) if out else None
    try:
        gen = LoadGenerator(spec, on_record=writer.write if writer else None)
        result = asyncio.run(run_with_progress(gen, Console(stderr=True)))
    finally:
        if writer is not None:
            writer.close()
            click.echo(f"wrote {writer.lines} records to {out}", err=True)
    print_summary(result, Console())
    if result.requests and not any(r.ok for r in result.requests):
        raise SourceError(no_request_completed(result))


def no_request_completed(result: LoadResult) -> str:
    """Why a sweep in which no request completed failed, in one line."""
    reasons = failure_reasons(result)
    if not result.abandoned:
        return f"every request failed ({len(result.requests)}), e.g.: {reasons[0][0]}"
    failed = len(result.requests) - result.abandoned
    parts = [f"{failed} failed, e.g.: {reasons[0][0]}"] if failed and reasons else []
    parts.append(f"{result.abandoned} abandoned when the drain time after the last level ran out")
    return "no request completed: " + "; ".join(parts)
