"""The run directory a capture writes, from its creation (none left behind by a capture refused at
start) to the one line a capture that could not write its backlog ends with."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from gputrace.config import Config
from gputrace.errors import StoreError
from gputrace.log_clock import LogClockOffset, log_clock_offset
from gputrace.logsetup import get_logger
from gputrace.store import Store, UnwrittenRows

log = get_logger("collect")


def lost_on_stop(run: Path, unwritten: Mapping[str, UnwrittenRows], error: str | None,
                  meta_error: str | None) -> str:
    """'stopped with N records not written (...)': the line a capture that lost its backlog ends with."""
    rows = sum(entry["rows"] for entry in unwritten.values())
    kinds = ", ".join(f"{entry['rows']} {name}" for name, entry in unwritten.items())
    spans = [(e["first_ns"], e["last_ns"]) for e in unwritten.values() if "first_ns" in e and "last_ns" in e]
    span = ""
    if spans:
        first_s, last_s = min(a for a, _ in spans) / 1e9, max(b for _, b in spans) / 1e9
        span = (f", from {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(first_s))} to "
                f"{time.strftime('%H:%M:%S', time.gmtime(last_s))} UTC")
    where = (f"counted in {run / 'meta.json'} (collector.unwritten_records)" if meta_error is None
             else f"meta.json could not record them either ({meta_error.rsplit(': ', 1)[-1]})")
    # the reason, without the database's wording around it ("No space left on device")
    reason = (error or "unknown").rsplit(": ", 1)[-1]
    return (f"stopped with {rows} records not written ({kinds}{span}): the store cannot be written "
            f"({reason}); {where}")


def install_stop_signals(stop: asyncio.Event) -> None:
    """SIGINT and SIGTERM set ``stop`` so the collector flushes and exits cleanly."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


@contextlib.contextmanager
def open_run_store(out: Path, cfg: Config) -> Iterator[Store]:
    """A new run directory for a capture (refuses to overwrite an existing run). A capture that
    fails before anything was stored (a refused listen, a host key, an unreachable host) leaves no
    run behind, so the retry can use the same --out."""
    store = Store.create(out, name=cfg.run_name or out.name,
                         config=json.loads(json.dumps(dict(cfg.raw), default=str)))
    try:
        store.reserve_meta_space()  # so a stop on a full disk still records what it lost
        yield store
    except BaseException:
        if store.is_empty():
            store.discard()
        else:
            store.close()
        raise
    store.close()


def log_clocks(store: Store) -> list[dict[str, object]]:
    """meta.json's ``log_clock``: each log whose stamps run off its receive times; those off by
    a zone's offset, consistently, moved back by it in the store (the report says so)."""
    out = []
    for host, source, found in log_clock_offsets(store):
        corrected = False
        if found.correctable:
            try:
                moved = store.shift_log_times(host, source, found.zone_offset_s * 10**9)
            except StoreError as exc:
                log.warning("log_clock_not_corrected", source=found.source, error=str(exc))
            else:
                corrected = True
                log.warning("log_clock_corrected", source=found.source, moved_back_s=found.zone_offset_s,
                            lines=moved, suggested_timezone=found.suggested_timezone())
        out.append(found.to_dict(corrected))
    return out


def log_clock_offsets(store: Store) -> list[tuple[str, str, LogClockOffset]]:
    """Each followed log whose stamps run more than a minute from when its lines arrived (an
    engine logging local time read as UTC put every line hours off, and nothing said so)."""
    try:
        table = store.log_and_receive_times()
    except StoreError as exc:
        log.warning("log_clock_not_checked", error=str(exc))
        return []
    if not table.num_rows:
        return []
    hosts = table.column("host").to_numpy(zero_copy_only=False)
    sources = table.column("source").to_numpy(zero_copy_only=False)
    log_ts = table.column("log_ts_ns").to_numpy().astype(np.float64)
    recv = table.column("recv_ts_ns").to_numpy().astype(np.float64)
    found = []
    for host, source in sorted(set(zip(hosts.tolist(), sources.tolist(), strict=True))):
        sel = (hosts == host) & (sources == source)
        offset = log_clock_offset(f"{host} {source}", log_ts[sel], recv[sel])
        if offset is not None:
            log.warning("log_clock_disagrees", source=offset.source, offset_s=round(offset.offset_s),
                        suggested_timezone=offset.suggested_timezone())
            found.append((host, source, offset))
    return found
