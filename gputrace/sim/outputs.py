"""A virtual run's outputs in the forms real sources give: the scheduler log file, nvidia-smi CSV,
and a complete run store (the log lines parsed by gputrace's own parser of the engine, as an import
would).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import tempfile
from pathlib import Path

import numpy as np

from gputrace.engines import LogParser
from gputrace.errors import SourceError
from gputrace.imports.engine_log import ingest_log
from gputrace.json_types import JsonObject
from gputrace.model import ClockProbe, DeviceInfo, EngineConfig, Marker, RequestRecord, SchedulerEvent
from gputrace.sim.engine_exposition import virtual_metric_rows
from gputrace.sim.samples import gpu_sample_columns, smi_csv_lines
from gputrace.sim.truth import work_intervals
from gputrace.sim.virtual import SimResult
from gputrace.store import Store
from gputrace.topology import single_node_placements, topology_to_meta

SIM_HOST = "sim-node0"
CLIENT_HOST = "sim-client"
LOG_SOURCE = "sim-log"
REQUEST_SOURCE = "gputrace-sim"
UNFINISHED = "not finished when the run ended"
METRICS_SOURCE = "http://127.0.0.1:30000/metrics"  # where the collector would have scraped it


def write_log(result: SimResult, path: str | os.PathLike[str]) -> int:
    """The scheduler log as the engine writes it; returns the number of lines."""
    Path(path).write_text("\n".join(result.log_lines) + "\n")
    return len(result.log_lines)


def sample_columns(result: SimResult) -> dict[str, np.ndarray | list[str]]:
    tr = result.engine.trace
    spans = work_intervals(np.asarray(tr.work_t, dtype=np.float64), np.asarray(tr.work_delta, dtype=np.int64))
    return gpu_sample_columns(result.params, result.start_ns, result.end_s, result.intervals,
                              np.asarray(tr.st_t, dtype=np.float64), np.asarray(tr.st_kv_used), SIM_HOST,
                              work_spans=spans)


def write_gpu_csv(result: SimResult, path: str | os.PathLike[str],
                  columns: dict[str, np.ndarray | list[str]] | None = None) -> int:
    """nvidia-smi ``--query-gpu ... --format=csv`` output of the run's samples; returns the rows."""
    cols = columns if columns is not None else sample_columns(result)
    with open(path, "w") as fh:
        lines = smi_csv_lines(result.params, cols)
        fh.write("\n".join(lines) + "\n")
    return len(cols["ts_ns"])


def run_date(result: SimResult) -> dt.date:
    """The virtual run's (UTC) date: vLLM's stamps carry month and day only."""
    return dt.datetime.fromtimestamp(result.start_ns / 1e9, dt.UTC).date()


def parse_log(result: SimResult) -> tuple[list[SchedulerEvent], list[EngineConfig], int]:
    """The log lines through gputrace's parser of the engine, stamped with their exact emission time
    (as if followed live on the same host); also the count of lines it did not recognise."""
    p = result.params
    parser = LogParser(host=SIM_HOST, source=LOG_SOURCE, engine=p.engine, date=run_date(result))
    events: list[SchedulerEvent] = []
    configs: list[EngineConfig] = []
    for line, ts_ns in zip(result.log_lines, result.log_ts_ns, strict=True):
        record = parser.feed(line, recv_ts_ns=ts_ns)
        if isinstance(record, SchedulerEvent):
            events.append(record)
        elif isinstance(record, EngineConfig):
            configs.append(record)
    return events, configs, parser.counts.unrecognised


def import_log(store: Store, result: SimResult) -> int:
    """The log through ``gputrace import``'s own path (ingest_log), then each event's recv_ts_ns
    set to the exact time its line was written (as a live follow on the same host stamps it)."""
    with tempfile.TemporaryDirectory(prefix="gputrace-sim-") as tmp:
        log = Path(tmp) / "scheduler.log"
        write_log(result, log)
        engine = result.params.engine
        stats = ingest_log(store, log, host=SIM_HOST, engine=engine, source=LOG_SOURCE,
                           date=run_date(result))
        if stats.unrecognised:
            raise SourceError(f"simulator: {stats.unrecognised} log lines the {engine} parser does not know")
        n_lines = len(result.log_ts_ns)
        store.set_receive_times(LOG_SOURCE, np.arange(1, n_lines + 1, dtype=np.int64),
                                np.asarray(result.log_ts_ns, dtype=np.int64))
    return stats.events_written


def request_records(result: SimResult) -> list[RequestRecord]:
    lat = result.params.client_latency_s
    out = []
    for req in result.requests:
        finished = req.finish_s is not None and req.finish_s <= result.end_s
        done = finished and req.generated >= req.output_tokens
        out.append(RequestRecord(
            host=CLIENT_HOST, request_id=f"sim-{req.rid:06d}", start_ns=result.ns(req.client_start_s),
            first_token_ns=result.ns(req.first_token_s + lat) if req.first_token_s is not None else None,
            end_ns=result.ns(req.finish_s + lat) if done and req.finish_s is not None else None,
            prompt_tokens=req.input_tokens, completion_tokens=req.generated if done else None,
            ok=done, error=None if done else UNFINISHED, phase=req.phase, source=REQUEST_SOURCE))
    return out


def device_records(result: SimResult) -> list[DeviceInfo]:
    p = result.params
    return [DeviceInfo(host=SIM_HOST, gpu_index=i, uuid=f"GPU-5151a000-0000-4000-8000-{i:012d}",
                       name=p.gpu_name, pci_bus_id=f"00000000:{0x18 + 0x10 * i:02X}:00.0",
                       pcie_max_gen=p.pcie_gen, pcie_max_width=p.pcie_width,
                       power_limit_w=p.power_limit_w, memory_total_bytes=p.memory_total_bytes)
            for i in range(p.pp_size * p.tp_size)]


def engine_metric_columns(store: Store, result: SimResult) -> dict[str, str | np.ndarray]:
    """The engine's /metrics scraped every second, from the lines already in ``store``."""
    events = store.columns("scheduler_events", order_by="line_no")
    done = [r for r in result.requests if r.finish_s is not None]
    finish = np.array([r.finish_s for r in done], dtype=np.float64)
    latency = finish - np.array([r.client_start_s for r in done], dtype=np.float64)
    return virtual_metric_rows(result.params, result.start_ns, result.end_s, result.engine.trace, events,
                               SIM_HOST, METRICS_SOURCE, (finish, latency))


def params_dict(result: SimResult) -> JsonObject:
    """The run's parameters as meta.json holds them (tuples as lists)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(result.params).items()}


def write_store(result: SimResult, out_dir: str | os.PathLike[str], name: str | None = None) -> Path:
    """A complete run store of the run (see the ground-truth conventions in the project brief)."""
    p = result.params
    placements = single_node_placements(SIM_HOST, p.pp_size, p.tp_size)
    topology = topology_to_meta(p.pp_size, p.tp_size, 1, placements, source="simulator")
    extra = {"ground_truth": result.ground_truth,
             "simulator": {"scenario": result.scenario, "seed": p.seed, "params": params_dict(result),
                           "virtual_time": True}}
    store = Store.create(out_dir, name=name or f"sim-{result.scenario}-{p.seed}",
                         config={"source": "simulator", "scenario": result.scenario}, topology=topology,
                         extra=extra)
    try:
        store.update_meta(created_ns=result.start_ns)  # a run's bytes depend on its seed only
        store.append(device_records(result))
        store.append_columns("gpu_samples", sample_columns(result))
        import_log(store, result)
        store.append_columns("engine_metrics", engine_metric_columns(store, result))
        store.append(request_records(result))
        markers = [Marker(host=CLIENT_HOST, ts_ns=result.ns(ph.start_s), label=ph.label, kind="phase",
                          target_concurrency=ph.target_concurrency) for ph in result.phases]
        markers.append(Marker(host=CLIENT_HOST, ts_ns=result.ns(result.phases[-1].end_s), label="end",
                              kind="end"))
        store.append(markers)
        probes = []
        for ph in result.phases:
            t = result.ns(ph.start_s)
            for host in (SIM_HOST, CLIENT_HOST):
                probes.append(ClockProbe(host=host, local_send_ns=t, remote_ns=t + 50_000,
                                         local_recv_ns=t + 100_000, via="ssh"))
        store.append(probes)
    finally:
        store.close()
    return Path(out_dir)
