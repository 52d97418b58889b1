"""One collector following many hosts: N test hosts on this machine (tests/testhosts.py: each its own
real sshd on 127.0.0.N and its own clock under libfaketime), each with a sim-backend agent sampling
8 GPUs at 10 Hz and an SGLang scheduler log appended at an engine's rate, all captured by one
`gputrace collect` over SSH for a given duration.

    python bench/collector_scale.py [--hosts 32] [--duration 600] [--gpus 8] [--sample-hz 10]
                                    [--lines-per-s 60] [--reference-duration 60] [--json] [--quick]

Printed, beside the same measurement with one host (the reference, run first in the same
invocation): the load the machine was under (its 1-minute load average before and after, and the
share of its cores busy), rows per second into the collector and written to the store (median
[p10, p90] over 5 s intervals), the backlogs at the start, middle and end with their spread and
trend per minute after the first fifth (the samples the agents took that the collector has not
pulled; the store writer's queue plus the log lines appended but not yet received): each must
stay flat; the collector's CPU (share of one core, and its ratio to the reference's) and RSS in
all and per host, and the lag from a line's append to its receipt by the collector (the store
adds at most its flush interval, 0.5 s, on top); the log lines and GPU samples lost or stored
twice. The collector is one asyncio process: one core is its limit, and `hosts per core`
extrapolates it.

The default log rate: SGLang's default --decode-log-interval 40 with ~4 ms forwards gives each of a
node's 8 PP ranks a decode line about every 0.13 s: ~60 lines/s per host.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from array import array
from pathlib import Path
from typing import Any

from gputrace.store import Store

TESTS = Path(__file__).resolve().parents[1] / "tests"
SAMPLE_EVERY_S = 5.0
_LINE = ("[{stamp} PP{rank}] Decode batch, #running-req: 8, #token: 4096, token usage: 0.31, "
         "cuda graph: True, gen throughput (token/s): 251.07, #queue-req: 24\n")


class LogWriter(threading.Thread):
    """Appends SGLang decode lines to every host's log at ``rate`` lines/s each; remembers when."""

    def __init__(self, paths: list[Path], rate: float):
        super().__init__(daemon=True)
        self.paths = paths
        self.rate = rate
        self.written = [array("q") for _ in paths]  # per host: time.time_ns() at each line's append
        self.stop = threading.Event()

    def run(self) -> None:
        fds = [os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) for p in self.paths]
        t0 = time.monotonic()
        try:
            while not self.stop.wait(0.05):
                due = int((time.monotonic() - t0) * self.rate)
                now_ns = time.time_ns()
                stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(now_ns / 1e9))
                for fd, written in zip(fds, self.written, strict=True):
                    n = due - len(written)
                    if n > 0:
                        first = len(written)
                        os.write(fd, "".join(_LINE.format(stamp=stamp, rank=(first + i) % 8)
                                             for i in range(n)).encode())
                        written.extend([now_ns] * n)
        finally:
            for fd in fds:
                os.close(fd)

    def total(self) -> int:
        return sum(len(w) for w in self.written)


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _proc_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _machine_busy_s() -> float:
    parts = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    values = [int(v) for v in parts]
    return (sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")


def _status(url: str, timeout_s: float = 10.0) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/v1/status", timeout=timeout_s) as resp:
        doc: dict[str, Any] = json.loads(resp.read())
        return doc


def _wait(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            if predicate():
                return
        time.sleep(0.2)
    raise RuntimeError(f"{what}: not ready within {timeout_s:.0f} s")


def _agent_newest_seq(url: str) -> int:
    """How many samples the agent has taken (its newest sequence number)."""
    with urllib.request.urlopen(url + "/v1/samples?since=0&limit=1", timeout=30) as resp:
        return int(resp.headers.get("X-Gputrace-Newest-Seq", 0))


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def measure(n_hosts: int, duration_s: float, gpus: int, sample_hz: float, lines_per_s: float,
            root: Path, say: Any, asyncio_debug: bool = False, profile: bool = False) -> dict[str, Any]:
    sys.path.insert(0, str(TESTS))
    testhosts = importlib.import_module("testhosts")  # the tests' own test hosts
    library = testhosts.libfaketime()
    if library is None:
        raise SystemExit("collector_scale: needs libfaketime (apt-get install faketime)")
    offsets = [round((i % 9 - 4) * 0.25, 3) for i in range(n_hosts)]  # -1 s .. +1 s
    with testhosts.running_test_hosts(root, offsets, library=library) as hosts:
        ports = [_free_port() for _ in hosts]
        for host, port in zip(hosts, ports, strict=True):
            host.log_path.touch()
            host.spawn_agent(port, interval_s=1.0 / sample_hz, feed=False, gpus=gpus)
        for host, port in zip(hosts, ports, strict=True):
            _wait(lambda h=host, p=port: urllib.request.urlopen(  # loopback only
                f"http://{h.address}:{p}/healthz", timeout=2).status == 200, 120, f"agent of {host.name}")
        say(f"{n_hosts} hosts up (sshd + agent each); collecting for {duration_s:.0f} s")
        cfg = root / "gputrace.toml"
        cfg.write_text("".join(h.host_toml(agent_port=p) for h, p in zip(hosts, ports, strict=True))
                       + "[topology]\npp_size = 8\n")
        writer = LogWriter([h.log_path for h in hosts], lines_per_s)
        listen_port = _free_port()
        url = f"http://127.0.0.1:{listen_port}"
        run_dir = root / "run"
        with open(root / "collector.out", "wb") as out:
            # cProfile sees the event loop's thread only: what holds the loop, not the executor's work
            profiler = ["-m", "cProfile", "-o", str(root / "collector.prof")] if profile else []
            collector = subprocess.Popen(
                [sys.executable, *profiler, "-m", "gputrace", "collect", "--config", str(cfg),
                 "--out", str(run_dir),
                 "--listen", f"127.0.0.1:{listen_port}"], stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, **({"PYTHONASYNCIODEBUG": "1"} if asyncio_debug else {})})
        rows: list[dict[str, float]] = []
        stalls: list[float] = []  # how long each /v1/status took: the event loop's responsiveness
        produced = 0
        try:
            _wait(lambda: _status(url) is not None, 120, "collector")
            writer.start()
            t0 = time.monotonic()
            cpu0, busy0 = _proc_cpu_s(collector.pid), _machine_busy_s()
            load_before = os.getloadavg()[0]
            prev: dict[str, float] | None = None
            while (elapsed := time.monotonic() - t0) < duration_s:
                time.sleep(min(SAMPLE_EVERY_S, duration_s - elapsed))
                asked = time.monotonic()
                try:
                    st = _status(url, timeout_s=60.0)
                except TimeoutError:
                    say("  the collector's /v1/status did not answer in 60 s: its event loop is stalled")
                    stalls.append(60.0)
                    continue
                stalls.append(time.monotonic() - asked)
                counts, store = st["counts"], st["store"]
                row = {"t_s": time.monotonic() - t0, "cpu_s": _proc_cpu_s(collector.pid) - cpu0,
                       "machine_busy_s": _machine_busy_s() - busy0, "rss_mb": _proc_rss_mb(collector.pid),
                       "in_rows": counts.get("log_lines", 0) + counts.get("gpu_samples", 0),
                       "written_rows": store["rows_written"], "store_backlog_rows": store["backlog_rows"],
                       "lines_in_flight": writer.total() - counts.get("log_lines", 0),
                       # the samples the agents took, those from before the capture included
                       # (_summarise takes those off: the samples waiting to be pulled are left)
                       "agents_newest_seq": sum(_agent_newest_seq(f"http://{h.address}:{p}")
                                                for h, p in zip(hosts, ports, strict=True)),
                       "gpu_samples_in": counts.get("gpu_samples", 0)}
                if prev is not None:
                    dt = row["t_s"] - prev["t_s"]
                    row["in_rows_per_s"] = (row["in_rows"] - prev["in_rows"]) / dt
                    row["written_rows_per_s"] = (row["written_rows"] - prev["written_rows"]) / dt
                    row["cpu_share"] = (row["cpu_s"] - prev["cpu_s"]) / dt
                    say(f"  t={row['t_s']:6.0f} s  in {row['in_rows_per_s']:7.0f} rows/s  written "
                        f"{row['written_rows_per_s']:7.0f} rows/s  store backlog "
                        f"{row['store_backlog_rows']:6.0f}"
                        f"  lines in flight {row['lines_in_flight']:5.0f}  samples taken - pulled "
                        f"{row['agents_newest_seq'] - row['gpu_samples_in']:6.0f}  cpu {row['cpu_share']:.0%}"
                        f"  rss {row['rss_mb']:.0f} MB")
                rows.append(row)
                prev = row
            writer.stop.set()
            writer.join()
            # the lines still on their way arrive before the collector is stopped (three minutes at most:
            # a line still on its way at the stop counts as lost)
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                with contextlib.suppress(OSError):
                    if writer.total() - _status(url, 60.0)["counts"].get("log_lines", 0) <= 0:
                        break
                time.sleep(1.0)
            time.sleep(1.0)
            produced = sum(_agent_newest_seq(f"http://{h.address}:{p}")
                           for h, p in zip(hosts, ports, strict=True))
            load_after = os.getloadavg()[0]
        finally:
            writer.stop.set()
            collector.send_signal(signal.SIGINT)
            try:
                collector.wait(timeout=60)
            except subprocess.TimeoutExpired:
                collector.kill()
                collector.wait()
    summary = _summarise(n_hosts, duration_s, rows, writer, run_dir, [h.name for h in hosts], stalls)
    # the agents' sequence numbers count every sample they took; read a second before the
    # collector stops, so the store may hold a few more
    summary["gpu_samples_taken"] = produced - summary.pop("samples_before_capture")
    summary["load_avg_1m_before"], summary["load_avg_1m_after"] = round(load_before, 2), round(load_after, 2)
    return summary


def _spread(values: list[float], digits: int = 1) -> str:
    """``median [p10, p90]`` of the values."""
    if not values:
        return "n/a"
    if len(values) < 2:
        return f"{values[0]:.{digits}f}"
    deciles = statistics.quantiles(values, n=10)
    return f"{statistics.median(values):.{digits}f} [{deciles[0]:.{digits}f}, {deciles[-1]:.{digits}f}]"


def _slope_per_min(rows: list[dict[str, float]], key: str) -> float:
    """The least-squares trend of ``key`` over the rows, per minute: flat is near 0."""
    if len(rows) < 2:
        return float("nan")
    t = [r["t_s"] / 60 for r in rows]
    return statistics.linear_regression(t, [r[key] for r in rows]).slope


def _stored_samples(store: Store) -> tuple[int, int, int]:
    """(samples the agents took before the first one stored, gaps in the stored seqs, duplicates),
    summed over the hosts. The capture starts at each agent's present: samples stamped before it
    are skipped, and those near the start come out of seq order in time (a GPU's driver samples
    and its ticks), so gaps are counted from the first seq stamped 5 s after the host's first
    sample: from there every sample an agent took is stored once and a gap is a sample lost."""
    before = gaps = duplicated = 0
    for (lo,) in store.sql("SELECT min(seq) FROM gpu_samples GROUP BY host"):
        before += lo - 1
    for lo, hi, n, distinct in store.sql(
            "WITH firsts AS (SELECT host, min(seq) AS lo FROM gpu_samples s WHERE ts_ns >= "
            "(SELECT min(ts_ns) + 5e9 FROM gpu_samples f WHERE f.host = s.host) GROUP BY host) "
            "SELECT f.lo, max(s.seq), count(*), count(DISTINCT s.seq) FROM gpu_samples s "
            "JOIN firsts f USING (host) WHERE s.seq >= f.lo GROUP BY s.host, f.lo"):
        gaps += hi - lo + 1 - distinct
        duplicated += n - distinct
    return before, gaps, duplicated


def _summarise(n_hosts: int, duration_s: float, rows: list[dict[str, float]], writer: LogWriter,
               run_dir: Path, names: list[str], stalls: list[float]) -> dict[str, Any]:
    lags_ms: list[float] = []
    lost = duplicated = 0
    with Store.open(run_dir, read_only=True) as store:
        for name, written in zip(names, writer.written, strict=True):
            recv = [r[0] for r in store.sql("SELECT recv_ts_ns FROM scheduler_events WHERE host = ? "
                                            "ORDER BY line_no", [name])]
            distinct = store.sql("SELECT count(DISTINCT line_no) FROM scheduler_events WHERE host = ?",
                                 [name])[0][0]
            duplicated += len(recv) - distinct
            lost += max(0, len(written) - distinct)
            # steady state: the lines appended after the first fifth of the run (while the
            # collector connects to the hosts one after another, the first lines wait for it)
            after_ns = written[0] + duration_s * 0.2e9 if len(written) else 0
            lags_ms += [(r - w) / 1e6 for r, w in zip(recv, written, strict=False)
                        if r is not None and w >= after_ns]
        samples = store.count("gpu_samples")
        before_capture, sample_gaps, samples_duplicated = _stored_samples(store)
    for r in rows:
        r["samples_waiting"] = r["agents_newest_seq"] - before_capture - r["gpu_samples_in"]
        r["log_backlog_rows"] = r["store_backlog_rows"] + r["lines_in_flight"]
    rated = [r for r in rows if "in_rows_per_s" in r]
    steady = rated[len(rated) // 5:]  # after the connect and the catch-up of the first fifth
    lags_ms.sort()

    def q(p: float) -> float:
        return round(lags_ms[min(len(lags_ms) - 1, int(p * len(lags_ms)))], 1) if lags_ms else float("nan")

    def start_middle_end(key: str) -> str:
        if not rated:
            return "n/a"
        return " / ".join(f"{rated[i][key]:.0f}" for i in (0, len(rated) // 2, -1))

    # the median of the intervals' shares: the connect and catch-up at the start do not count
    cpu_share = statistics.median(r["cpu_share"] for r in rated) if rated else float("nan")
    machine = rows[-1]["machine_busy_s"] / rows[-1]["t_s"] / (os.cpu_count() or 1) if rows else float("nan")
    return {
        "hosts": n_hosts, "duration_s": duration_s,
        "in_rows_per_s_median": round(statistics.median(r["in_rows_per_s"] for r in rated), 1)
        if rated else None,
        "in_rows_per_s [p10, p90]": _spread([r["in_rows_per_s"] for r in rated], 0),
        "written_rows_per_s [p10, p90]": _spread([r["written_rows_per_s"] for r in rated], 0),
        "samples_waiting start/mid/end": start_middle_end("samples_waiting"),
        "samples_waiting [p10, p90]": _spread([r["samples_waiting"] for r in steady], 0),
        "samples_waiting_trend_per_min": round(_slope_per_min(steady, "samples_waiting"), 1),
        "log_backlog start/mid/end": start_middle_end("log_backlog_rows"),
        "log_backlog [p10, p90]": _spread([r["log_backlog_rows"] for r in steady], 0),
        "log_backlog_trend_per_min": round(_slope_per_min(steady, "log_backlog_rows"), 1),
        "collector_cpu_share_of_core": round(cpu_share, 3),
        "cpu_share [p10, p90]": _spread([r["cpu_share"] for r in rated], 3),
        "collector_cpu_s": round(rows[-1]["cpu_s"], 1) if rows else None,
        "collector_rss_mb": round(rows[-1]["rss_mb"], 1) if rows else None,
        "machine_busy_share": round(machine, 3),
        "status_answer_s_max": round(max(stalls or [0.0]), 2),
        "lag_ms_p50": q(0.5), "lag_ms_p99": q(0.99), "lag_ms_max": q(1.0),
        "log_lines_written": writer.total(), "log_lines_lost": lost, "log_lines_duplicated": duplicated,
        "samples_before_capture": before_capture,
        "gpu_samples_stored": samples, "gpu_samples_lost": sample_gaps,
        "gpu_samples_duplicated": samples_duplicated,
        "timeline": [{k: round(v, 2) for k, v in r.items()} for r in rows],
    }


def _print_profile(path: Path) -> None:
    import pstats

    print(f"  the collector's event loop thread, by own time ({path}):", flush=True)
    pstats.Stats(str(path)).sort_stats("tottime").print_stats(25)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=32)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of collection")
    ap.add_argument("--gpus", type=int, default=8, help="GPUs per host")
    ap.add_argument("--sample-hz", type=float, default=10.0)
    ap.add_argument("--lines-per-s", type=float, default=60.0, help="scheduler log lines per host per s")
    ap.add_argument("--reference-duration", type=float, default=60.0, help="seconds for the 1-host reference")
    ap.add_argument("--json", action="store_true", help="also print every figure and the timelines as JSON")
    ap.add_argument("--asyncio-debug", action="store_true",
                    help="run the collector with PYTHONASYNCIODEBUG=1: it logs every callback over 0.1 s")
    ap.add_argument("--profile", action="store_true",
                    help="run the collector under cProfile and print where its event loop spent its time")
    ap.add_argument("--keep", type=Path, help="keep the hosts' files and the run stores in this folder")
    ap.add_argument("--quick", action="store_true",
                    help="small inputs, one repeat: the users' code path (tests/test_bench_quick.py)")
    args = ap.parse_args()
    if args.quick:
        args.hosts, args.duration, args.reference_duration, args.gpus = 2, 8.0, 5.0, 2

    def say(text: str) -> None:
        print(text, flush=True)

    results = []
    with contextlib.ExitStack() as stack:
        tmp = args.keep or stack.enter_context(tempfile.TemporaryDirectory(prefix="gputrace-scale-"))
        for n, duration in ((1, args.reference_duration), (args.hosts, args.duration)):
            root = Path(tmp) / f"hosts{n}"
            root.mkdir(parents=True)
            say(f"== {n} host(s), {args.gpus} GPUs at {args.sample_hz:g} Hz and {args.lines_per_s:g} "
                f"log lines/s each")
            results.append(measure(n, duration, args.gpus, args.sample_hz, args.lines_per_s, root, say,
                                   args.asyncio_debug, args.profile))
            if args.profile:
                _print_profile(root / "collector.prof")
            if args.asyncio_debug:
                slow = [line for line in (root / "collector.out").read_text(errors="replace").splitlines()
                        if "Executing" in line and "took" in line]
                say(f"  callbacks over 0.1 s: {len(slow)}; slowest: "
                    + " | ".join(sorted(slow, key=lambda t: -float(t.rsplit("took ", 1)[1].split()[0]))[:3]))
    ref, big = results
    extra = max(1, big["hosts"] - ref["hosts"])
    # per host: what each host beyond the reference's one adds
    for r in (ref, big):
        r["cpu_share_ratio_to_reference"] = round(
            r["collector_cpu_share_of_core"] / ref["collector_cpu_share_of_core"], 2)
        r["collector_cpu_share_per_host"] = round(
            (big["collector_cpu_share_of_core"] - ref["collector_cpu_share_of_core"]) / extra, 4)
        r["collector_rss_mb_per_host"] = round((big["collector_rss_mb"] - ref["collector_rss_mb"]) / extra, 2)
        per_host = r["collector_cpu_share_per_host"]
        r["hosts_per_core"] = round(1 + (1 - ref["collector_cpu_share_of_core"]) / per_host) \
            if per_host > 0 else None
    big_label = f"{big['hosts']} hosts"
    print(f"\n{'':34s}{'1 host (reference)':>24s}{big_label:>24s}")
    for key in ("duration_s", "load_avg_1m_before", "load_avg_1m_after", "machine_busy_share",
                "in_rows_per_s_median", "in_rows_per_s [p10, p90]", "written_rows_per_s [p10, p90]",
                "samples_waiting start/mid/end", "samples_waiting [p10, p90]",
                "samples_waiting_trend_per_min",
                "log_backlog start/mid/end", "log_backlog [p10, p90]", "log_backlog_trend_per_min",
                "collector_cpu_share_of_core", "cpu_share [p10, p90]", "cpu_share_ratio_to_reference",
                "collector_cpu_s", "collector_cpu_share_per_host", "hosts_per_core", "collector_rss_mb",
                "collector_rss_mb_per_host", "status_answer_s_max",
                "lag_ms_p50", "lag_ms_p99", "lag_ms_max", "log_lines_written", "log_lines_lost",
                "log_lines_duplicated", "gpu_samples_taken", "gpu_samples_stored", "gpu_samples_lost",
                "gpu_samples_duplicated"):
        print(f"{key:34s}{ref[key]!s:>24s}{big[key]!s:>24s}")
    if args.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
