"""`gputrace watch --collector URL` reading the collector's /v1/status from a real local HTTP server:
a body that is no status object is said in one line, the view keeps running (it shows the line)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import aiohttp
import pytest

from gputrace.commands.watch import read_status
from gputrace.errors import SourceError


@pytest.fixture
def status_body() -> Iterator[tuple[str, list[bytes]]]:
    """A server answering /v1/status with the last body put in the list (JSON)."""
    bodies: list[bytes] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = bodies[-1]
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:  # keep the test's output to the test
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", bodies
    finally:
        server.shutdown()
        thread.join(timeout=5)
        server.server_close()


async def test_a_status_that_is_no_object_is_one_source_error(status_body: tuple[str, list[bytes]]) -> None:
    """A JSON array (a proxy's or another service's answer) is a SourceError naming the URL (it was
    an AttributeError: 'list' object has no attribute 'get'); an object is read as the status."""
    url, bodies = status_body
    async with aiohttp.ClientSession() as session:
        bodies.append(b"[1, 2]")
        with pytest.raises(SourceError, match=r"/v1/status: not a collector's status \(a JSON object\)$"):
            await read_status(session, url)
        bodies.append(b'{"run": "r1", "phase": "C=8", "stages": [{"pp_rank": 0, "busy_ratio": 0.5}]}')
        status = await read_status(session, url)
    assert (status.run, status.phase) == ("r1", "C=8")
    assert [dict(row) for row in status.stages] == [{"pp_rank": 0, "busy_ratio": 0.5}]
