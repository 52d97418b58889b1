"""`gputrace mark LABEL`: post a phase marker to a running collector."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request

import click

from gputrace.errors import SourceError, UsageError


@click.command("mark")
@click.argument("label")
@click.option("--kind", type=click.Choice(["phase", "end", "note"]), default="phase", show_default=True,
              help="phase: a load phase starts here; end: the last phase ends; note: just a note.")
@click.option("--concurrency", type=int, default=None, help="The phase's target concurrency, if any.")
@click.option("--url", default=None, help="The collector's mark URL [default: $GPUTRACE_MARK_URL].")
def command(label: str, kind: str, concurrency: int | None, url: str | None) -> None:
    """Mark the start of a load phase (e.g. `gputrace mark C=64`) in the running capture."""
    url = url or os.environ.get("GPUTRACE_MARK_URL")
    if not url:
        raise UsageError("no collector to mark: pass --url or run under `gputrace run`, "
                         "which sets GPUTRACE_MARK_URL")
    body = {"label": label, "kind": kind, "target_concurrency": concurrency, "ts_ns": time.time_ns()}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            resp.read()
    except urllib.error.HTTPError as exc:
        raise SourceError(f"{url}: the collector refused the mark: HTTP {exc.code} "
                          f"{exc.read().decode(errors='replace')[:200]}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise SourceError(f"{url}: cannot reach the collector: {getattr(exc, 'reason', exc)}") from exc
    click.echo(f"marked {kind} {label!r}", err=True)
