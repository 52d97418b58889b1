"""The interface every GPU backend implements (NVML, simulated), so the agent never knows which.

A backend returns two kinds of GpuSample from ``sample``: *tick* records stamped ``now_ns`` with the
instantaneous metrics (power, clocks, memory, PCIe, ...), and *driver* records stamped with the
driver's own timestamp that carry only the utilization ratios (one per NVML sample period), so every
utilization value keeps the time the driver measured it at. When a backend has no per-period
samples it puts the utilization on the tick record instead.
"""

from __future__ import annotations

from dataclasses import fields
from operator import attrgetter
from typing import Any, Protocol

from gputrace.model import DeviceInfo, GpuSample

# The agent keeps samples as rows: every GpuSample field's value in field order, so that
# ``GpuSample(*row)`` is the record. A tuple of plain values costs a tenth of building the frozen
# dataclass, and the garbage collector stops tracking it (it matters for a ring of 10^5-10^6).
SampleRow = tuple[Any, ...]
ROW_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(GpuSample))
ROW_INDEX: dict[str, int] = {name: i for i, name in enumerate(ROW_FIELDS)}
_row_of = attrgetter(*ROW_FIELDS)


def sample_row(s: GpuSample) -> SampleRow:
    """The row form of a record (``GpuSample(*sample_row(s)) == s``)."""
    row: SampleRow = _row_of(s)
    return row


class Sampler(Protocol):
    """A source of GpuSample records for the GPUs of one host."""

    backend: str  # "nvml" | "sim"
    lag_ns: int  # how far behind ``now_ns`` the tick records are stamped (0: at it)

    def devices(self) -> list[DeviceInfo]:
        """Static facts about each GPU, in index order."""
        ...

    def sample(self, now_ns: int) -> list[GpuSample]:
        """Every new reading since the previous call; ``now_ns - lag_ns`` stamps the tick records."""
        ...

    def sample_rows(self, now_ns: int) -> list[SampleRow]:
        """``sample`` as rows (what the agent's loop calls; a backend may build them directly)."""
        ...

    def versions(self) -> dict[str, str | None]:
        """Driver and library versions for /v1/info (None where not applicable)."""
        ...

    def close(self) -> None:
        """Release the backend (NVML shutdown, feed file closed)."""
        ...
