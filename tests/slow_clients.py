"""Hostile clients for the HTTP servers' limits: connections that send part of a request and then
nothing, and a server process held to a small file-descriptor limit (systemd's default is 1,024)."""

from __future__ import annotations

import contextlib
import resource
import socket
import time
from collections.abc import Callable, Iterator

import pytest

PARTIAL_REQUEST = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "  # the header never ends


def raise_own_fd_limit(needed: int) -> None:
    """This process holds every slow client's socket: lift its soft limit to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"needs {needed} open files; the hard limit here is {hard}")
    if soft != resource.RLIM_INFINITY and soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def fd_limit_of(n: int) -> Callable[[], None]:
    """A ``preexec_fn`` that holds the child to ``n`` open files."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))
    return limit


@contextlib.contextmanager
def half_sent_requests(port: int, count: int) -> Iterator[list[socket.socket]]:
    """``count`` connections to 127.0.0.1:port, each having sent an unfinished request header."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(PARTIAL_REQUEST)
            socks.append(sock)
        yield socks
    finally:
        for sock in socks:
            sock.close()


def closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """Whether the server closes ``sock`` (EOF or reset) within ``within_s``."""
    sock.settimeout(within_s)
    try:
        return sock.recv(4096) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def get_within(port: int, path: str, timeout_s: float) -> tuple[int, float]:
    """A whole GET on a fresh connection: (status, seconds taken); raises past ``timeout_s``."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
        head = sock.recv(4096)
    return int(head.split(b" ", 2)[1]), time.monotonic() - started
