"""The interface every GPU backend implements (NVML, simulated), so the agent never knows which.

A backend returns two kinds of GpuSample from ``sample``: *tick* records stamped ``now_ns`` with the
instantaneous metrics (power, clocks, memory, PCIe, ...), and *driver* records stamped with the
driver's own timestamp that carry only the utilization ratios (one per NVML sample period), so every
utilization value keeps the time the driver measured it at. When a backend has no per-period
samples it puts the utilization on the tick record instead.
"""

from __future__ import annotations

from typing import Protocol

from gputrace.model import DeviceInfo, GpuSample


class Sampler(Protocol):
    """A source of GpuSample records for the GPUs of one host."""

    backend: str  # "nvml" | "sim"

    def devices(self) -> list[DeviceInfo]:
        """Static facts about each GPU, in index order."""
        ...

    def sample(self, now_ns: int) -> list[GpuSample]:
        """Every new reading since the previous call; ``now_ns`` stamps the tick records."""
        ...

    def versions(self) -> dict[str, str | None]:
        """Driver and library versions for /v1/info (None where not applicable)."""
        ...

    def close(self) -> None:
        """Release the backend (NVML shutdown, feed file closed)."""
        ...
