"""Prometheus HTTP API ``query_range``, split into windows of at most 11,000 steps (the server's
limit per series) and stitched back into one series per label set.

Times are integer milliseconds: Prometheus evaluates at start + i * step with millisecond
precision, so windows built on that grid meet without a duplicated or missing step.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog

from gputrace.backoff import Backoff
from gputrace.errors import SourceError, UsageError

log = structlog.get_logger(__name__)

MAX_POINTS_PER_SERIES = 11_000
"""Prometheus refuses a range query longer than this many steps per series."""

LabelKey = tuple[tuple[str, str], ...]

# An answer that says "later" (a proxy's 502/504, an overloaded Prometheus' 503, a rate limit's 429)
# is asked again, up to ATTEMPTS times in all, after Retry-After (at most RETRY_AFTER_MAX_S) or a
# back-off; so is a dropped connection once Prometheus has answered (an import of many windows
# must not be lost to one), but not a first contact that fails (a wrong URL says so at once).
RETRY_STATUSES = frozenset({429, 502, 503, 504})
ATTEMPTS = 4
RETRY_AFTER_MAX_S = 30.0
RETRY_BACKOFF = Backoff(initial_s=0.5, max_s=8.0)


class _Later(Exception):
    """One call's answer that is worth asking again; ``wait_s`` from Retry-After, if given."""

    def __init__(self, error: SourceError, wait_s: float | None) -> None:
        super().__init__(str(error))
        self.error, self.wait_s = error, wait_s


@dataclass(frozen=True, slots=True)
class Series:
    """One stitched series: its labels (``__name__`` included), step times (ms) and values."""

    labels: dict[str, str]
    ts_ms: np.ndarray
    values: np.ndarray


def chunk_windows(start_ms: int, end_ms: int, step_ms: int,
                  max_points: int = MAX_POINTS_PER_SERIES) -> list[tuple[int, int]]:
    """[start, end] windows on the grid start + i * step, each at most ``max_points`` steps, the
    next one starting one step after the previous one's end."""
    if step_ms < 1:
        raise UsageError(f"--step must be at least 1 ms (got {step_ms} ms)")
    if end_ms < start_ms:
        raise UsageError("--end is before --start")
    if max_points < 1:
        raise UsageError(f"max_points must be >= 1 (got {max_points})")
    n = (end_ms - start_ms) // step_ms + 1
    return [(start_ms + i * step_ms, start_ms + (min(i + max_points, n) - 1) * step_ms)
            for i in range(0, n, max_points)]


def _seconds(ms: int) -> str:
    return f"{ms // 1000}.{ms % 1000:03d}"


class PrometheusClient:
    """A small synchronous client for the HTTP API (optionally with a bearer token)."""

    def __init__(self, base_url: str, token: str | None = None, timeout_s: float = 60.0,
                 backoff: Backoff = RETRY_BACKOFF,
                 sleep: Callable[[float], None] = time.sleep):
        parsed = urllib.parse.urlsplit(base_url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise UsageError(f"--prometheus {base_url!r}: give an http(s):// URL")
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s
        self.backoff, self.sleep = backoff, sleep
        self.queries = 0  # range queries sent, for the import summary and tests
        self.retries = 0  # calls asked again (RETRY_STATUSES, a dropped connection)
        self.answered = False  # Prometheus has answered once: a dropped connection is worth a retry

    def get(self, path: str, params: Mapping[str, str], post: bool = False) -> Any:
        """``data`` of one API call; queries go as a form POST (long selectors do not fit a URL).
        An answer that says "later" is asked again (RETRY_STATUSES)."""
        for attempt in range(ATTEMPTS):
            try:
                return self._get_once(path, params, post)
            except _Later as later:
                if attempt == ATTEMPTS - 1:
                    raise later.error from later
                wait_s = later.wait_s if later.wait_s is not None else self.backoff.delay_s(attempt)
                self.retries += 1
                log.warning("prometheus_retry", error=str(later.error), retry_s=round(wait_s, 2))
                self.sleep(wait_s)
        raise AssertionError("unreachable")  # the loop returns or raises

    def _get_once(self, path: str, params: Mapping[str, str], post: bool) -> Any:
        query = urllib.parse.urlencode(params)
        if post:
            req = urllib.request.Request(f"{self.base_url}{path}", data=query.encode(), method="POST",
                                         headers={"Content-Type": "application/x-www-form-urlencoded"})
        else:
            req = urllib.request.Request(f"{self.base_url}{path}?{query}")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                doc = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            error = SourceError(f"Prometheus {self.base_url}{path}: HTTP {exc.code}: {_api_error(exc)}")
            if exc.code in RETRY_STATUSES:
                raise _Later(error, _retry_after_s(exc.headers.get("Retry-After"))) from exc
            raise error from exc
        except TimeoutError as exc:  # a query that took this long will take as long again
            raise SourceError(f"Prometheus {self.base_url}{path}: no answer within {self.timeout_s:g} s "
                              "(a shorter range or a coarser --step asks less)") from exc
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            error = SourceError(f"Prometheus {self.base_url} unreachable: {reason}")
            if self.answered:
                raise _Later(error, None) from exc
            raise error from exc
        except ValueError as exc:
            raise SourceError(f"Prometheus {self.base_url}{path}: the answer is not JSON") from exc
        self.answered = True
        if not isinstance(doc, dict) or doc.get("status") != "success":
            err = doc.get("error") if isinstance(doc, dict) else None
            raise SourceError(f"Prometheus {self.base_url}{path}: {err or 'unexpected answer'}")
        return doc.get("data")

    def query_range(self, expr: str, start_ms: int, end_ms: int, step_ms: int) -> list[Series]:
        """One ``query_range`` call (the caller keeps it within the point limit)."""
        self.queries += 1
        params = {"query": expr, "start": _seconds(start_ms), "end": _seconds(end_ms),
                  "step": _seconds(step_ms)}
        data = self.get("/api/v1/query_range", params, post=True)
        if not isinstance(data, dict) or data.get("resultType") != "matrix":
            raise SourceError(f"Prometheus {self.base_url}: {expr}: expected a range vector")
        out = []
        for item in data.get("result", []):
            pairs = item.get("values", [])
            ts = np.rint(np.array([p[0] for p in pairs], dtype=np.float64) * 1000).astype(np.int64)
            vals = np.array([p[1] for p in pairs], dtype=np.float64) if pairs else np.zeros(0)
            out.append(Series(dict(item.get("metric", {})), ts, vals))
        return out

    def query_range_chunked(self, expr: str, start_ms: int, end_ms: int, step_ms: int,
                            max_points: int = MAX_POINTS_PER_SERIES) -> list[Series]:
        """``query_range`` over [start, end] in windows of at most ``max_points`` steps, stitched
        per label set in time order."""
        parts: dict[LabelKey, list[Series]] = {}
        for lo, hi in chunk_windows(start_ms, end_ms, step_ms, max_points):
            for s in self.query_range(expr, lo, hi, step_ms):
                parts.setdefault(tuple(sorted(s.labels.items())), []).append(s)
        return [Series(dict(key), np.concatenate([p.ts_ms for p in ps]),
                       np.concatenate([p.values for p in ps])) for key, ps in parts.items()]


def _retry_after_s(value: str | None) -> float | None:
    """Retry-After in seconds (the HTTP-date form is not used by Prometheus or common proxies)."""
    try:
        seconds = float(value or "")
    except ValueError:
        return None
    return min(max(seconds, 0.0), RETRY_AFTER_MAX_S) if math.isfinite(seconds) else None


def _api_error(exc: urllib.error.HTTPError) -> str:
    """The API's own error text when the body carries one (Prometheus answers JSON on 4xx/5xx)."""
    try:
        doc = json.loads(exc.read())
        return str(doc.get("error") or exc.reason)
    except (ValueError, OSError, AttributeError):
        return str(exc.reason)

