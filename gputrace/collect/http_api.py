"""The collector's HTTP endpoints: /metrics (the live view), /v1/mark, /v1/status and /healthz,
behind the bearer token when one is set (required beyond loopback, as the agent's)."""

from __future__ import annotations

from collections.abc import Callable

from gputrace.collect.marks import MarkWriter
from gputrace.errors import UsageError
from gputrace.exposition import metrics_handler
from gputrace.httpserver import (
    HttpLimits,
    HttpListener,
    bearer_auth,
    has_token,
    parse_listen,
    require_token_beyond_loopback,
    web,
)
from gputrace.live import LiveCollector, LiveState
from gputrace.logsetup import get_logger
from gputrace.vocabulary import CaptureProblem, LiveStatus

log = get_logger("collect")


class CollectorApi:
    """The endpoints over the collector's live view, marks, status and problems."""

    def __init__(self, live: LiveState, marks: MarkWriter, status: Callable[[], LiveStatus],
                 problems: Callable[[], list[CaptureProblem]], failures: list[str], *,
                 token: str | None, insecure: bool, limits: HttpLimits):
        self.live, self.marks, self.status, self.problems = live, marks, status, problems
        self.failures = failures  # the collector's list, read at each request
        self.token = token or None
        self.insecure = insecure
        self.limits = limits

    async def start(self, listen: str) -> tuple[HttpListener, str]:
        """Listen on ``listen`` (HOST:PORT); the listener and the URL it is reached at."""
        host, port = parse_listen(listen, example_port=9401)
        require_token_beyond_loopback(
            host, self.token, self.insecure,
            refusal=f"--listen {listen}: listening beyond loopback needs a token (--token-file) or "
                    "--insecure",
            warning="collector endpoints open to the network without authentication (--insecure): "
                    "anyone who reaches the port can post marks", listen=listen)
        auth = [bearer_auth(self.token, "gputrace-collector")] if self.token else []
        app = web.Application(middlewares=auth)
        app.router.add_get("/metrics", metrics_handler(LiveCollector(self.live), auto_describe=True))
        app.router.add_post("/v1/mark", self.marks.handle)
        app.router.add_get("/v1/status", self._status)
        app.router.add_get("/healthz", self._healthz)
        listener = HttpListener(app, "collector", self.limits)
        try:
            bound = await listener.start(host, port)
        except OSError as exc:
            raise UsageError(f"--listen {listen}: cannot listen: {exc.strerror}") from exc
        url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{bound}"
        log.info("collector_listening", url=url)
        return listener, url

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response(self.status().to_dict())

    async def _healthz(self, request: web.Request) -> web.Response:
        """200 while every source delivers and the store takes what they send; 503 with the
        problems otherwise (a full disk said ok while every sample was kept in memory only). Open
        without the token, as the agent's is; then it says only whether."""
        problems = self.problems()
        status = 503 if problems else 200
        if not has_token(request, self.token):
            return web.json_response({"ok": not problems}, status=status)
        return web.json_response({"ok": not problems, "problems": [p.to_dict() for p in problems],
                                  "failures": self.failures},
                                 status=status)
