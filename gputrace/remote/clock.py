"""NTP-style clock-offset probes of a host over its transport: local send ns, the host's ns, local
receive ns; the probe with the smallest round trip bounds the offset best."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator

from gputrace.errors import SourceError, TransportError
from gputrace.logsetup import get_logger
from gputrace.model import ClockProbe
from gputrace.remote.transport import StreamedCommand, Transport

log = get_logger("remote.clock")

# One shell loop per prober: each newline we send is answered with the host's time, so a probe costs
# one round trip on an open channel (no channel set-up or process start inside the measured span,
# except `date` itself, which runs after the send and before the reply, i.e. inside the midpoint).
_CLOCK_LOOP = ["sh", "-c", "while IFS= read -r _; do date +%s%N; done"]


class ClockProber:
    """Probes one host's clock over one long-lived channel; reopens it after a failure."""

    def __init__(self, transport: Transport, host: str | None = None, *, timeout_s: float = 5.0,
                 via: str = "ssh") -> None:
        self.transport = transport
        self.host = host or transport.host
        self.timeout_s = timeout_s
        self.via = via
        self._stream: StreamedCommand | None = None
        self._buffer = b""

    async def _once(self) -> ClockProbe:
        if self._stream is None:
            self._stream = await self.transport.open_stream(_CLOCK_LOOP, watchdog=False)
            self._buffer = b""
        stream = self._stream
        send_ns = time.time_ns()
        await stream.write(b"\n")
        while True:
            while b"\n" not in self._buffer:
                chunk = await asyncio.wait_for(stream.read(256), timeout=self.timeout_s)
                if not chunk:
                    raise TransportError(
                        f"{self.host}: the clock probe channel closed: {stream.stderr_tail()}")
                self._buffer += chunk
            recv_ns = time.time_ns()
            line, _, self._buffer = self._buffer.partition(b"\n")
            if line.strip().isdigit():
                break
            if line.rstrip().endswith(b"N"):  # a `date` without %N (not GNU/busybox)
                raise SourceError(f"{self.host}: `date +%s%N` printed {line[:40]!r}, not nanoseconds")
            # Anything else is what a login script printed before the loop started: skip it.
        return ClockProbe(host=self.host, local_send_ns=send_ns, remote_ns=int(line),
                          local_recv_ns=recv_ns, via=self.via)

    async def probe(self, samples: int = 8) -> ClockProbe:
        """``samples`` probes in a row; the one with the smallest round trip."""
        best: ClockProbe | None = None
        for _ in range(samples):
            try:
                probe = await self._once()
            except (TransportError, TimeoutError) as exc:
                await self.close()
                if isinstance(exc, TimeoutError):
                    raise TransportError(f"{self.host}: no clock reply within {self.timeout_s:g} s") from exc
                raise
            if best is None or probe.rtt_ns < best.rtt_ns:
                best = probe
        assert best is not None
        return best

    async def close(self) -> None:
        if self._stream is not None:
            stream, self._stream = self._stream, None
            await stream.close()


async def probe_clock(transport: Transport, host: str | None = None, *, samples: int = 8,
                      via: str = "ssh") -> ClockProbe:
    """One best-of-``samples`` probe of ``transport``'s host clock."""
    prober = ClockProber(transport, host, via=via)
    try:
        return await prober.probe(samples)
    finally:
        await prober.close()


async def probe_clock_periodically(
    transport: Transport, host: str | None = None, *, interval_s: float = 30.0, samples: int = 8,
    via: str = "ssh",
) -> AsyncGenerator[ClockProbe, None]:
    """A best-of-``samples`` probe now and every ``interval_s`` (to follow drift during a run).

    A failed round is logged and skipped (the transport reconnects on the next one); a host whose
    ``date`` cannot print nanoseconds raises SourceError.
    """
    prober = ClockProber(transport, host, via=via)
    try:
        while True:
            started = time.monotonic()
            try:
                yield await prober.probe(samples)
            except TransportError as exc:
                log.warning("clock_probe_failed", host=prober.host, error=str(exc))
            await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))
    finally:
        await prober.close()
