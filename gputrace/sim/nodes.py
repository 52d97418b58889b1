"""One simulated engine over several nodes, as SGLang's ``--nnodes N --node-rank r
--dist-init-addr HOST:PORT`` runs one engine: node 0 runs the engine model and the HTTP endpoint;
every other node is a process that writes its own ranks' scheduler log lines and its own GPUs' feed,
stamped with **its own clock**.

Node 0 sends each node its records in simulated time (seconds since the engine started) over one
TCP connection (JSON lines); a node turns them into its wall clock with ``time.time_ns()`` read once
at the hello. So a node started under libfaketime (or on another machine) writes timestamps that are
off by exactly its clock's offset, as a real node's are: the skew is real to every program reading
the clock, not added by the simulator.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO

from gputrace.engines import ENGINE_WORDS
from gputrace.engines.simulated import StepFields, StepLineWriter
from gputrace.errors import SourceError, UsageError
from gputrace.logsetup import get_logger
from gputrace.sim.params import SimParams

log = get_logger("sim.nodes")

FEED_KIND = "gputrace-sim-gpu"
# one logged step sent to the node whose rank writes it: (seconds into the run, stage, kind, values)
NodeRecord = tuple[float, int, str, StepFields]
CONNECT_TIMEOUT_S = 60.0  # how long node 0 waits for the others, and they retry reaching it


@dataclass(frozen=True, slots=True)
class NodeLayout:
    """Where the engine places each rank: (pp_rank, tp_rank) -> (node_rank, gpu_id on that node)."""

    nnodes: int
    gpu_of: dict[tuple[int, int], tuple[int, int]]

    @classmethod
    def of(cls, p: SimParams, nnodes: int) -> NodeLayout:
        """The simulated engine's ranks over ``nnodes`` nodes, by its placement rule."""
        gpu_of = {(at.pp_rank, at.tp_rank): (node, at.gpu_index)
                  for node in range(nnodes)
                  for at in p.engine_spec.placements(f"sim-node{node}", pp_size=p.pp_size, tp_size=p.tp_size,
                                                     nnodes=nnodes, node_rank=node)}
        return cls(nnodes, gpu_of)

    def node_of_stage(self, stage: int) -> int:
        """The node whose TP-0 rank of ``stage`` writes the stage's log lines."""
        return self.gpu_of[(stage, 0)][0]

    def ranks_on(self, node: int) -> list[tuple[int, int]]:
        return sorted(r for r, (n, _) in self.gpu_of.items() if n == node)

    def gpus_on(self, node: int) -> int:
        return len({g for n, g in self.gpu_of.values() if n == node})


def real_time_lines(p: SimParams) -> StepLineWriter:
    """The simulated engine's log lines as its ranks write them while it runs; a one-line error
    where its package gives none (the simulator serves it in virtual time only)."""
    simulated = p.engine_spec.simulated
    if simulated is None or simulated.step_lines is None:
        served = " and ".join(e.name for e in ENGINE_WORDS.values()
                              if e.simulated is not None and e.simulated.step_lines is not None)
        raise UsageError(f"sim serve: only the {served} model serves in real time; the "
                         f"{p.engine_spec.name} model runs in virtual time (gputrace sim --scenario ... "
                         f"--set engine={p.engine})")
    return simulated.step_lines(p)


def parse_dist_init_addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--dist-init-addr {text!r}: expected HOST:PORT")
    return host, int(port)


class NodeFiles:
    """A node's scheduler log and GPU feed, written in this process's clock from simulated times."""

    def __init__(self, p: SimParams, layout: NodeLayout, node_rank: int, log_path: str | os.PathLike[str],
                 feed_path: str | os.PathLike[str] | None, wall0_ns: int, speed: float):
        self.p = p
        self.node_rank = node_rank
        self.wall0_ns = wall0_ns
        self.speed = speed
        self.lines = real_time_lines(p)
        try:
            self.log: IO[str] = open(log_path, "a", encoding="utf-8")  # noqa: SIM115  # closed in close()
            self.feed: IO[bytes] | None = open(feed_path, "ab") if feed_path else None  # noqa: SIM115
        except OSError as exc:
            raise SourceError(f"simulator node {node_rank}: cannot open its output file: {exc}") from exc
        self.log.write("\n".join(self.lines.startup(wall0_ns, layout.ranks_on(node_rank))) + "\n")
        self.log.flush()
        if self.feed is not None:
            header = {"feed": FEED_KIND, "version": 1, "host": f"sim-node{node_rank}",
                      "gpus": layout.gpus_on(node_rank), "gpu_name": p.gpu_name,
                      "power_limit_w": p.power_limit_w, "idle_power_w": p.idle_power_w,
                      "pcie_gen": p.pcie_gen, "pcie_width": p.pcie_width,
                      "memory_total_bytes": p.memory_total_bytes}
            self.feed.write((json.dumps(header) + "\n").encode())
            self.feed.flush()

    def wall_ns(self, t_s: float) -> int:
        return self.wall0_ns + round(t_s / self.speed * 1e9)

    def write_log(self, records: list[NodeRecord]) -> None:
        """(t_s, stage, kind, fields) in time order -> the stage's scheduler log lines."""
        if not records:
            return
        out = []
        for t_s, stage, kind, fields in records:
            out.append(self.lines.step(self.wall_ns(t_s), stage, kind, fields) + "\n")
        self.log.write("".join(out))
        self.log.flush()

    def write_feed(self, intervals: list[tuple[float, float, int, int, int]]) -> None:
        """(start_s, end_s, gpu_id, tx_bytes, rx_bytes) -> the feed's busy intervals."""
        if self.feed is None or not intervals:
            return
        out = [f'{{"gpu": {g}, "start_ns": {self.wall_ns(a)}, "end_ns": {self.wall_ns(b)}, '
               f'"tx_bytes": {tx}, "rx_bytes": {rx}}}\n' for a, b, g, tx, rx in intervals]
        self.feed.write("".join(out).encode())
        self.feed.flush()

    def close(self) -> None:
        self.log.close()
        if self.feed is not None:
            self.feed.close()


class NodeRelay:
    """Node 0's side: the connections to nodes 1..N-1, each sent its records as they happen."""

    def __init__(self, writers: dict[int, asyncio.StreamWriter], server: asyncio.Server):
        self.writers = writers
        self._server = server

    @classmethod
    async def accept(cls, host: str, port: int, nnodes: int,
                     timeout_s: float = CONNECT_TIMEOUT_S) -> NodeRelay:
        """Listen on ``host:port`` until every other node has said which it is."""
        writers: dict[int, asyncio.StreamWriter] = {}
        all_in = asyncio.Event()

        async def hello(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                msg = json.loads(await asyncio.wait_for(reader.readline(), timeout=10))
                rank = int(msg["node_rank"])
            except (ValueError, KeyError, TypeError, TimeoutError, OSError):
                writer.close()
                return
            if not 0 < rank < nnodes or rank in writers:
                log.warning("sim_node_refused", node_rank=rank)
                writer.close()
                return
            writers[rank] = writer
            if len(writers) == nnodes - 1:
                all_in.set()

        try:
            server = await asyncio.start_server(hello, host, port)
        except OSError as exc:
            raise SourceError(f"simulator node 0: cannot listen on {host}:{port} "
                              f"(--dist-init-addr): {exc.strerror}") from exc
        try:
            await asyncio.wait_for(all_in.wait(), timeout=timeout_s)
        except TimeoutError:
            server.close()
            missing = sorted(set(range(1, nnodes)) - set(writers))
            raise SourceError(f"simulator node 0: nodes {missing} did not connect to {host}:{port} "
                              f"within {timeout_s:g} s") from None
        return cls(writers, server)

    def start(self, t_s: float, speed: float) -> None:
        """Tell every node the engine's simulated time now: each fixes its wall clock to it."""
        for writer in self.writers.values():
            writer.write((json.dumps({"t_s": t_s, "speed": speed}) + "\n").encode())

    def send(self, node: int, log_records: list[NodeRecord],
             intervals: list[tuple[float, float, int, int, int]]) -> None:
        writer = self.writers.get(node)
        if writer is None or writer.is_closing() or not (log_records or intervals):
            return
        writer.write((json.dumps({"log": log_records, "iv": intervals}) + "\n").encode())

    async def close(self) -> None:
        for writer in self.writers.values():
            with contextlib.suppress(OSError, ConnectionError):
                await writer.drain()
            writer.close()
        self._server.close()


async def run_node(p: SimParams, layout: NodeLayout, node_rank: int, addr: tuple[str, int],
                   log_path: str, feed_path: str | None, stop: asyncio.Event,
                   clock_ns: Callable[[], int] = time.time_ns) -> None:
    """Node ``node_rank`` (> 0): reach node 0, then write what it sends until it closes or ``stop``."""
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        try:
            reader, writer = await asyncio.open_connection(*addr, limit=1 << 26)
            break
        except OSError as exc:
            if time.monotonic() > deadline or stop.is_set():
                raise SourceError(f"simulator node {node_rank}: cannot reach node 0 at "
                                  f"{addr[0]}:{addr[1]}: {exc.strerror}") from exc
            await asyncio.sleep(0.1)
    writer.write((json.dumps({"node_rank": node_rank}) + "\n").encode())
    files: NodeFiles | None = None
    stopper = asyncio.create_task(stop.wait())
    try:
        while True:
            line_task = asyncio.create_task(reader.readline())
            await asyncio.wait({line_task, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if not line_task.done():
                line_task.cancel()
                break
            line = line_task.result()
            if not line:
                break  # node 0 ended: so does this node, as SGLang's do
            msg = json.loads(line)
            if files is None:
                # the moment node 0 said its simulated time, in this node's own clock
                wall0_ns = clock_ns() - round(float(msg["t_s"]) / float(msg["speed"]) * 1e9)
                files = NodeFiles(p, layout, node_rank, log_path, feed_path, wall0_ns, float(msg["speed"]))
                log.info("sim_node_started", node_rank=node_rank)
                continue
            files.write_log([(float(t), int(s), str(k), f) for t, s, k, f in msg.get("log", [])])
            files.write_feed([(float(a), float(b), int(g), int(tx), int(rx))
                              for a, b, g, tx, rx in msg.get("iv", [])])
    finally:
        stopper.cancel()
        writer.close()
        if files is not None:
            files.close()


def serve_node_forever(p: SimParams, nnodes: int, node_rank: int, dist_init_addr: str, log_path: str,
                       feed_path: str | None) -> None:
    """``gputrace sim serve --nnodes N --node-rank r`` for r > 0, until node 0 ends or SIGINT/SIGTERM."""
    layout = NodeLayout.of(p, nnodes)
    addr = parse_dist_init_addr(dist_init_addr)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await run_node(p, layout, node_rank, addr, log_path, feed_path, stop)

    asyncio.run(main())
