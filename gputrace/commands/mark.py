"""`gputrace mark LABEL`: post a phase marker to a running collector."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit, urlunsplit

import click

from gputrace.errors import SourceError, UsageError

MARK_PATH = "/v1/mark"


def mark_url(url: str, given_as: str = "--url") -> str:
    """The collector's mark endpoint from ``url``: its base URL (``http://host:9401``) gets
    /v1/mark added (a bare base URL was answered with a bare 404)."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise UsageError(f"{given_as} {url!r}: expected the collector's URL, e.g. http://127.0.0.1:9401{MARK_PATH}")
    if parts.path in ("", "/"):
        parts = parts._replace(path=MARK_PATH)
    return urlunsplit(parts)


@click.command("mark")
@click.argument("label")
@click.option("--kind", type=click.Choice(["phase", "end", "note"]), default="phase", show_default=True,
              help="phase: a load phase starts here; end: the last phase ends; note: just a note.")
@click.option("--concurrency", type=int, default=None, help="The phase's target concurrency, if any.")
@click.option("--url", default=None, help="The collector's mark URL [default: $GPUTRACE_MARK_URL].")
def command(label: str, kind: str, concurrency: int | None, url: str | None) -> None:
    """Mark the start of a load phase (e.g. `gputrace mark C=64`) in the running capture."""
    given_as = "--url" if url else "GPUTRACE_MARK_URL"
    url = url or os.environ.get("GPUTRACE_MARK_URL")
    if not url:
        raise UsageError("no collector to mark: pass --url or run under `gputrace run`, "
                         "which sets GPUTRACE_MARK_URL")
    url = mark_url(url, given_as)
    body = {"label": label, "kind": kind, "target_concurrency": concurrency, "ts_ns": time.time_ns()}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            resp.read()
    except urllib.error.HTTPError as exc:
        if exc.code in (404, 405):
            raise SourceError(f"{url}: HTTP {exc.code}: no collector takes marks there; give the "
                              f"collector's URL, e.g. http://127.0.0.1:9401{MARK_PATH}") from exc
        raise SourceError(f"{url}: the collector refused the mark: HTTP {exc.code} "
                          f"{exc.read().decode(errors='replace')[:200]}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise SourceError(f"{url}: cannot reach the collector: {getattr(exc, 'reason', exc)}") from exc
    click.echo(f"marked {kind} {label!r}", err=True)
