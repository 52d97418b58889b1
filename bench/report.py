"""Time and peak memory of `gputrace report` on 8 GPUs x 1 h and 64 GPUs x 1 h at 10 Hz, beside a
plain pandas merge_asof + groupby reference computing the same phase-by-stage table (busy, bubble,
micro-batch size, power per phase and stage) in the same run.

    python bench/report.py [--hours H] [--gpus 8,64] [--source sim|synth] [--quick]
    python bench/report.py --scale 8,64,512 --hours 8     # `gputrace report` alone, growing GPUs

Each measurement runs in a fresh child process (peak RSS = its ru_maxrss). Runs come from the
simulator by default (the microbatch-cap preset as PP8 x TP(n/8), four levels of H/4 each, 10 Hz
NVML samples); --source synth writes a comparable run directly into a store instead. The two
tables are checked to agree (max |difference| of busy/bubble fractions is printed).

Then the real command's CPU seconds (`gputrace report`, the what-if's effects and the advice
included) beside two DuckDB SQL references on the same store: the busy column alone (one ASOF
JOIN, GROUP BY: cheaper than the report's table, which also needs the requests in flight for the
bubble), and the whole table the report computes (checked against it).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from gputrace.model import DeviceInfo, EngineConfig, Marker
from gputrace.store import Store
from gputrace.topology import single_node_placements, topology_to_meta

T0 = 1_764_486_000_000_000_000
PERIOD_NS = 100_000_000
LEVELS = (1, 8, 32, 64)
SAMPLES_PER_APPEND = 1 << 20


def synthesise(path: Path, n_gpus: int, hours: float, seed: int = 0) -> None:
    """A PP8 run store of n_gpus GPUs (TP = n_gpus // 8) and `hours` of data, vectorised."""
    rng = np.random.default_rng(seed)
    pp, tp = 8, max(n_gpus // 8, 1)
    placements = single_node_placements("node0", pp, tp)
    n = int(hours * 3600e9 // PERIOD_NS)
    ts = T0 + PERIOD_NS * np.arange(1, n + 1, dtype=np.int64)
    level_len = n // len(LEVELS)
    level = np.minimum(np.arange(n) // level_len, len(LEVELS) - 1)
    busy = np.minimum(1.0, np.array(LEVELS)[level] / 64 + 0.05)
    gpu_index = np.array([p.gpu_index for p in placements], dtype=np.int64)
    with Store.create(path, topology=topology_to_meta(pp, tp, 1, placements, "bench")) as store:
        # In time order, every GPU's samples of a few minutes per append, as a collector writes them
        # (a store read by time range reads only the row groups of that range).
        block = max(SAMPLES_PER_APPEND // len(placements), 1)
        for b0 in range(0, n, block):
            b1 = min(b0 + block, n)
            u = np.clip(busy[b0:b1, None] + rng.normal(0, 0.08, (b1 - b0, len(placements))), 0, 1).ravel()
            m = len(u)
            store.append_columns("gpu_samples", {
                "host": "node0", "gpu_index": np.tile(gpu_index, b1 - b0),
                "ts_ns": np.repeat(ts[b0:b1], len(placements)),
                "utilization_ratio": u, "power_w": 60 + 290 * u,
                "pcie_tx_bytes_per_s": u * 2e9, "pcie_rx_bytes_per_s": u * 2e9,
                "sm_clock_hz": np.full(m, 1.98e9), "seq": np.repeat(np.arange(b0, b1), len(placements))})
        store.append([DeviceInfo("node0", p.gpu_index, power_limit_w=350.0, pcie_max_gen=5,
                                 pcie_max_width=16) for p in placements])
        store.append([EngineConfig("node0", "log", "sglang", 0, pp_size=pp, tp_size=tp,
                                   max_running_requests=64, decode_log_interval=1)])
        marks = [Marker("client", int(ts[i * level_len] - PERIOD_NS), f"C={c}", "phase", c)
                 for i, c in enumerate(LEVELS)]
        store.append([*marks, Marker("client", int(ts[-1]), "end", "end")])
        # Decode lines: every stage twice a second, second-resolution log time plus receive time.
        ev_t = T0 + np.arange(0, int(hours * 3600 * 2), dtype=np.int64) * 500_000_000
        ev_level = np.minimum((ev_t - T0) // (level_len * PERIOD_NS), len(LEVELS) - 1)
        for s in range(pp):
            m = len(ev_t)
            store.append_columns("scheduler_events", {
                "host": "node0", "source": "log", "engine": "sglang", "kind": "decode",
                "line_no": np.arange(m) * pp + s, "log_ts_ns": ev_t // 1_000_000_000 * 1_000_000_000,
                "ts_resolution_ns": np.full(m, 1_000_000_000), "recv_ts_ns": ev_t + 1000 * s,
                "pp_rank": np.full(m, s), "tp_rank": np.zeros(m, dtype=np.int64),
                "running_req": np.minimum(np.array(LEVELS)[ev_level], 8), "queue_req": np.zeros(m),
                "token_usage": np.full(m, 0.3), "gen_throughput_tok_s": np.full(m, 250.0)})
        # Closed-loop requests: C lanes per level, 8 s each.
        starts, ends, labels = [], [], []
        for i, c in enumerate(LEVELS):
            lo, hi = int(ts[i * level_len] - PERIOD_NS), int(ts[min((i + 1) * level_len, n) - 1])
            s0 = np.arange(lo, hi - 8_000_000_000, 8_000_000_000, dtype=np.int64)
            for lane in range(c):
                starts.append(s0 + lane * 1_000_000)
                labels += [f"C={c}"] * len(s0)
        start = np.concatenate(starts)
        ends = start + 8_000_000_000
        k = len(start)
        store.append_columns("requests", {
            "host": "client", "request_id": [f"r{i}" for i in range(k)], "start_ns": start,
            "first_token_ns": start + 200_000_000, "end_ns": ends, "prompt_tokens": np.full(k, 128),
            "completion_tokens": np.full(k, 256), "ok": np.ones(k, dtype=bool), "phase": labels})


def simulate(path: Path, n_gpus: int, hours: float) -> None:
    from gputrace.sim.outputs import write_store
    from gputrace.sim.virtual import run_scenario

    result = run_scenario("microbatch-cap", 0, {"phase_s": hours * 3600 / 4, "tp_size": max(n_gpus // 8, 1),
                                                "sample_period_s": PERIOD_NS / 1e9})
    write_store(result, path)


def child_report(run: str, out: str) -> dict[str, object]:
    from gputrace.analyse import analyse_run
    from gputrace.report.document import phase_stage_table
    from gputrace.report.render import write_report

    t0 = time.perf_counter()
    with Store.open(run, read_only=True) as store:
        # the one entry, as `gputrace compare` and `export` call it (the report adds the what-if's
        # effects and the advice: the real command's CPU seconds are the command row below)
        a = analyse_run(store, effects=False)
    table_s = time.perf_counter() - t0
    write_report(a, out, ["html", "md", "json"])
    keys = ("phase", "pp_rank", "busy_fraction", "bubble_fraction")
    return {"table_s": table_s, "table": [{k: r[k] for k in keys} for r in phase_stage_table(a)]}


def child_command(run: str, out: str) -> dict[str, object]:
    """The real `gputrace report` command (analysis, the what-if's effects and the advice, the
    figures and the three formats), in this process; its CPU seconds."""
    from gputrace.cli import main as gputrace_main
    from gputrace.whatif.replay import replay_session

    c0 = time.process_time()
    with replay_session() as replays:  # the command's analysis counts its replays in it
        gputrace_main(["report", run, "--out", out, "--no-progress", "--format", "html,md,json"])
    return {"cpu_s": time.process_time() - c0, "replays": replays.replays, "steps": replays.steps,
            "shared": replays.cached, "stopped": f"{replays.phases_stopped}/{replays.phases}"}


def _placement_rows(store: Store) -> str:
    """The topology's (host, gpu_index, pp_rank) as SQL VALUES rows."""
    placements: list[dict[str, object]] = store.meta.topology["placements"]  # type: ignore[assignment]
    return ", ".join(f"('{p['host']}', {int(str(p['gpu_index']))}, {int(str(p['pp_rank']))})"
                     for p in placements)


def child_sql(run: str) -> dict[str, object]:
    """DuckDB SQL: the phase-by-stage busy column alone, GPU samples ASOF JOINed onto the phase
    markers, GROUP BY phase and stage; its CPU seconds. Cheaper than the table the report
    computes (no bubble: no requests in flight; no power, no micro-batch): see child_sql_table."""
    c0 = time.process_time()
    with Store.open(run, read_only=True) as store:
        values = _placement_rows(store)
        rows = store.sql(
            f"WITH pl(host, gpu_index, pp_rank) AS (VALUES {values}), "
            "m AS (SELECT ts_ns, label FROM markers), "
            "s AS (SELECT g.ts_ns - 100000000 AS win_ns, g.utilization_ratio AS u, pl.pp_rank "
            "      FROM gpu_samples g JOIN pl USING (host, gpu_index)) "
            "SELECT m.label, s.pp_rank, avg(s.u) AS busy, count(*) AS n "
            "FROM s ASOF JOIN m ON s.win_ns >= m.ts_ns WHERE m.label <> 'end' "
            "GROUP BY 1, 2 ORDER BY 1, 2")
    return {"cpu_s": time.process_time() - c0, "rows": len(rows)}


def child_sql_table(run: str) -> dict[str, object]:
    """DuckDB SQL: the whole phase-by-stage table the report computes, as the pandas reference
    does: each GPU sample's window onto its phase (ASOF JOIN on the markers) and onto the requests
    in flight at its start (ASOF JOIN on their running count: work present or not), busy, bubble
    (work - busy, floored at 0) and power share per sample, the stage's value per timestamp (the
    mean over its TP GPUs), then the phase means; the decode lines' mean running requests per
    phase and stage beside it. Its CPU seconds, and the table for the comparison."""
    c0 = time.process_time()
    with Store.open(run, read_only=True) as store:
        values = _placement_rows(store)
        rows = store.sql(
            f"WITH pl(host, gpu_index, pp_rank) AS (VALUES {values}), "
            "m AS (SELECT ts_ns, label, kind FROM markers), "
            # requests in flight after each start (+1) or end (-1); an unfinished one to the end
            "last AS (SELECT max(ts_ns) + 100000000 AS t FROM gpu_samples), "
            "d AS (SELECT start_ns AS t, 1 AS d FROM requests UNION ALL "
            "      SELECT coalesce(end_ns, (SELECT t FROM last)), -1 FROM requests), "
            "inflight AS (SELECT t, last_value(n) OVER (PARTITION BY t) AS n FROM "
            "             (SELECT t, sum(d) OVER (ORDER BY t ROWS UNBOUNDED PRECEDING) AS n FROM d)), "
            "fl AS (SELECT DISTINCT t, n FROM inflight), "
            f"s AS (SELECT g.ts_ns, g.ts_ns - {PERIOD_NS} AS win_ns, g.utilization_ratio AS u, "
            "      g.power_w, g.power_w / dv.power_limit_w AS share, pl.pp_rank "
            "      FROM gpu_samples g JOIN pl USING (host, gpu_index) "
            "      JOIN devices dv USING (host, gpu_index)), "
            "sm AS (SELECT s.*, m.label FROM s ASOF JOIN m ON s.win_ns >= m.ts_ns WHERE m.kind = 'phase'), "
            "sw AS (SELECT sm.*, CASE WHEN coalesce(fl.n, 0) > 0 THEN 1.0 ELSE 0.0 END AS work "
            "       FROM sm ASOF LEFT JOIN fl ON sm.win_ns >= fl.t), "
            "per_t AS (SELECT label, pp_rank, ts_ns, avg(u) AS u, avg(greatest(work - u, 0)) AS bubble, "
            "          avg(power_w) AS power_w, avg(share) AS share FROM sw GROUP BY ALL), "
            "tab AS (SELECT label, pp_rank, avg(u) AS busy, avg(bubble) AS bubble, avg(power_w) AS power_w, "
            "        avg(share) AS share FROM per_t GROUP BY ALL), "
            "ev AS (SELECT e.pp_rank, e.running_req, m.label FROM scheduler_events e "
            "       ASOF JOIN m ON e.recv_ts_ns >= m.ts_ns WHERE e.kind = 'decode'), "
            "mb AS (SELECT label, pp_rank, avg(running_req) AS mb FROM ev GROUP BY ALL) "
            "SELECT tab.*, mb.mb FROM tab LEFT JOIN mb USING (label, pp_rank) ORDER BY 1, 2")
    return {"cpu_s": time.process_time() - c0,
            "table": [{"phase": r[0], "pp_rank": int(r[1]), "busy_fraction": r[2], "bubble_fraction": r[3]}
                      for r in rows]}


def child_reference(run: str) -> dict[str, object]:
    """pandas: merge_asof GPU samples onto phases and in-flight counts, groupby phase and stage."""
    import pandas as pd

    with Store.open(run, read_only=True) as store:
        samples = store.arrow("gpu_samples").to_pandas()
        markers = store.arrow("markers").to_pandas()
        reqs = store.arrow("requests").to_pandas()
        events = store.arrow("scheduler_events").to_pandas()
        placements = pd.DataFrame(store.meta.topology["placements"])
        devices = store.arrow("devices").to_pandas()
    samples = samples.merge(placements[["host", "gpu_index", "pp_rank"]], on=["host", "gpu_index"])
    samples = samples.merge(devices[["host", "gpu_index", "power_limit_w"]], on=["host", "gpu_index"])
    samples = samples.sort_values("ts_ns")
    marks = markers.sort_values("ts_ns")[["ts_ns", "label", "kind"]].rename(columns={"ts_ns": "m_ts"})
    # A sample covers (ts - P, ts]: its phase is the one in force at the window's start.
    samples["win_ns"] = samples["ts_ns"] - PERIOD_NS
    samples = pd.merge_asof(samples.sort_values("win_ns"), marks, left_on="win_ns", right_on="m_ts")
    samples = samples[samples["kind"] == "phase"]
    ends = reqs["end_ns"].fillna(samples["ts_ns"].max() + PERIOD_NS).astype("int64")  # unfinished
    delta = pd.concat([pd.DataFrame({"t": reqs["start_ns"].astype("int64"), "d": 1}),
                       pd.DataFrame({"t": ends, "d": -1})]).sort_values("t", kind="stable")
    delta["inflight"] = delta["d"].cumsum()
    delta = delta.groupby("t", as_index=False)["inflight"].last()
    samples = pd.merge_asof(samples.sort_values("win_ns"), delta, left_on="win_ns", right_on="t")
    samples["work"] = (samples["inflight"].fillna(0) > 0).astype(float)
    samples["bubble"] = (samples["work"] - samples["utilization_ratio"]).clip(lower=0)
    samples["power_share"] = samples["power_w"] / samples["power_limit_w"]
    # Stage value per timestamp (mean over TP GPUs), then the phase mean.
    per_t = samples.groupby(["label", "pp_rank", "ts_ns"], as_index=False)[
        ["utilization_ratio", "bubble", "power_w", "power_share"]].mean()
    table = per_t.groupby(["label", "pp_rank"], as_index=False).mean()
    dec = events[events["kind"] == "decode"].copy()
    dec = pd.merge_asof(dec.sort_values("recv_ts_ns"), marks, left_on="recv_ts_ns", right_on="m_ts")
    mb = dec.groupby(["label", "pp_rank"], as_index=False)["running_req"].mean()
    table = table.merge(mb, on=["label", "pp_rank"], how="left")
    return {"table": [{"phase": r.label, "pp_rank": int(r.pp_rank), "busy_fraction": r.utilization_ratio,
                       "bubble_fraction": r.bubble} for r in table.itertuples()]}


def child_command_process(run: str, out: str, timeout_s: float) -> dict[str, object]:
    """The command users run, `gputrace report RUN` (what-if and all), in its own process: its
    peak RSS is this process's largest child's; stopped after ``timeout_s``."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([str(Path(sys.executable).with_name("gputrace")), "report", run, "--out", out,
                               "--no-progress"], capture_output=True, text=True, timeout=timeout_s or None)
    except subprocess.TimeoutExpired:
        proc = None
    if proc is not None and proc.returncode:
        raise SystemExit(f"gputrace report failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"wall_s": time.perf_counter() - t0, "cpu_s": usage.ru_utime + usage.ru_stime,
            "command_rss_mb": usage.ru_maxrss / 1024, "finished": proc is not None,
            "findings": proc.stdout.count(" -> ") if proc is not None else None}


def scale(hours: float, gpus: list[int], timeout_s: float) -> None:
    """The report on synthetic stores of growing GPU counts: time and peak RSS, and their growth
    from the smallest; without the what-if (read, align, analyse, figures, HTML/MD/JSON) and the
    whole `gputrace report` command."""
    print(f"the report on synthetic PP8 stores, {hours:g} h at 10 Hz (one run each)")
    print(f"{'GPUs':>5} {'samples':>12} {'store GB':>9} | {'no what-if: s':>13} {'CPU s':>7} {'RSS MB':>7} "
          f"{'time x':>6} {'RSS x':>6} | {'gputrace report: s':>18} {'CPU s':>7} {'RSS MB':>7}")
    base: tuple[float, float] | None = None
    for n_gpus in gpus:
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
            run = Path(tmp) / "run"
            subprocess.run([sys.executable, __file__, "--make", "synth", str(n_gpus), str(hours), str(run)],
                           check=True)
            size_gb = sum(f.stat().st_size for f in run.iterdir()) / 1e9
            wall, mb, res = run_child(["--child", "report", str(run), str(Path(tmp) / "a")])
            cpu = float(res["cpu_s"])  # type: ignore[arg-type]
            base = base or (wall, mb)
            samples = n_gpus * int(hours * 3600e9 // PERIOD_NS)
            line = (f"{n_gpus:>5} {samples:>12,} {size_gb:>9.2f} | {wall:>13.1f} {cpu:>7.1f} {mb:>7.0f} "
                    f"{wall / base[0]:>5.1f}x {mb / base[1]:>5.1f}x | ")
            if timeout_s:
                _, _, cmd = run_child(["--child", "command-process", str(run), str(Path(tmp) / "out"),
                                       str(timeout_s)])
                done = "" if cmd["finished"] else f" (stopped at {timeout_s:g} s)"
                line += (f"{float(cmd['wall_s']):>18.1f} {float(cmd['cpu_s']):>7.1f} "  # type: ignore[arg-type]
                         f"{float(cmd['command_rss_mb']):>7.0f}{done}")  # type: ignore[arg-type]
            print(line, flush=True)
    print("s: wall seconds of a fresh process; CPU s: its CPU time; RSS MB: its peak RSS; x: against the\n"
          "first row. GPU samples are read a time range at a time and reduced to stages, so memory\n"
          "follows stages x cells, not GPUs x hours. gputrace report adds the what-if (every phase\n"
          "replayed in the simulator), stopped after --command-timeout")


def run_child(args: list[str]) -> tuple[float, float, dict[str, object]]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return wall, float(result.pop("peak_rss_mb")), result


def _median_run(runs: list[tuple[float, float, dict[str, object]]]) -> tuple[float, float, dict[str, object]]:
    """The run with the median wall time; its peak memory is the largest of all runs."""
    ordered = sorted(runs, key=lambda r: r[0])
    wall, _, res = ordered[len(ordered) // 2]
    return wall, max(r[1] for r in runs), res


def compare_tables(a: list[dict[str, object]], b: list[dict[str, object]]) -> float:
    """The largest difference in busy or bubble fraction between the two tables."""
    kb = {(r["phase"], r["pp_rank"]): r for r in b}
    worst = 0.0
    for r in a:
        other = kb[(r["phase"], r["pp_rank"])]
        for key in ("busy_fraction", "bubble_fraction"):
            worst = max(worst, abs(float(r[key]) - float(other[key])))  # type: ignore[arg-type]
    return worst


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--make":
        # In its own process: Linux keeps a forked child's peak RSS across exec, so the parent
        # must stay small while it starts the measured children.
        n_gpus, hours, path = int(sys.argv[3]), float(sys.argv[4]), Path(sys.argv[5])
        (simulate if sys.argv[2] == "sim" else synthesise)(path, n_gpus, hours)
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        kind, run = sys.argv[2], sys.argv[3]
        t0 = time.perf_counter()
        if kind == "report":
            res = child_report(run, sys.argv[4])
        elif kind == "command-process":
            res = child_command_process(run, sys.argv[4], float(sys.argv[5]))
        elif kind == "command":
            res = child_command(run, sys.argv[4])
        elif kind == "sql":
            res = child_sql(run)
        elif kind == "sql-table":
            res = child_sql_table(run)
        else:
            res = child_reference(run)
        res["seconds"] = time.perf_counter() - t0
        usage = resource.getrusage(resource.RUSAGE_SELF)
        res.setdefault("cpu_s", usage.ru_utime + usage.ru_stime)
        res["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(res, default=float))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hours", type=float, default=1.0)
    ap.add_argument("--gpus", default="8,64")
    ap.add_argument("--source", choices=("sim", "synth"), default="sim")
    ap.add_argument("--repeats", type=int, default=3, help="Runs of each, interleaved; medians shown.")
    ap.add_argument("--quick", action="store_true",
                    help="small inputs, one repeat: the users' code path (tests/test_bench_quick.py)")
    ap.add_argument("--scale", metavar="GPUS", default=None,
                    help="Instead: `gputrace report` alone on synthetic stores of these GPU counts "
                         "(e.g. 8,64,512 with --hours 8), printing the growth of time and peak RSS.")
    ap.add_argument("--command-timeout", type=float, default=1800,
                    help="With --scale: seconds the whole `gputrace report` may take; 0: skip it.")
    ap.add_argument("--no-command", dest="command", action="store_false",
                    help="Skip the real `gputrace report` against the DuckDB SQL reference.")
    args = ap.parse_args()
    if args.quick:  # three minutes of 8 GPUs: every child and the real command, once
        args.hours, args.gpus, args.repeats = 0.05, "8", 1
    if args.scale:
        scale(args.hours, [int(g) for g in args.scale.split(",")], args.command_timeout)
        return
    cpu_rows: list[str] = []
    print(f"{'run':>16} {'report s':>9} {'(table s)':>9} {'report MB':>10} {'pandas s':>9} "
          f"{'(table s)':>9} {'pandas MB':>10} {'speedup':>8} {'max |diff|':>10}")
    for n_gpus in (int(g) for g in args.gpus.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            run = Path(tmp) / "run"
            subprocess.run([sys.executable, __file__, "--make", args.source, str(n_gpus), str(args.hours),
                            str(run)], check=True)
            r_runs, p_runs = [], []
            for _ in range(args.repeats):  # interleaved, so both see the same machine load
                r_runs.append(run_child(["--child", "report", str(run), str(Path(tmp) / "out")]))
                p_runs.append(run_child(["--child", "reference", str(run)]))
            r_wall, r_mb, r_res = _median_run(r_runs)
            p_wall, p_mb, p_res = _median_run(p_runs)
            diff = compare_tables(r_res["table"], p_res["table"])  # type: ignore[arg-type]
            if args.command:
                cpu_rows.append(command_cpu(n_gpus, args.hours, run, Path(tmp), args.repeats,
                                            r_res["table"]))  # type: ignore[arg-type]
            print(f"{n_gpus:>3} GPUs x {args.hours:g} h {r_wall:>9.2f} {r_res['table_s']:>9.2f} "
                  f"{r_mb:>10.0f} {p_wall:>9.2f} {p_res['seconds']:>9.2f} {p_mb:>10.0f} "
                  f"{p_wall / r_wall:>7.2f}x {diff:>10.4f}")
    print(f"medians of {args.repeats} interleaved runs; MB is the largest peak RSS of them")
    print("report s / pandas s: wall time of a fresh process each, including imports (the report also\n"
          "draws 5 figures and writes HTML, Markdown and JSON); (table s): reading the store and\n"
          "computing the phase-by-stage table only; MB: peak RSS; speedup = pandas s / report s")
    print_command_rows(cpu_rows)


def command_cpu(n_gpus: int, hours: float, run: str | Path, tmp: str | Path, repeats: int,
                report_table: list[dict[str, object]]) -> str:
    """One row: the real command's CPU seconds beside the DuckDB SQL references' (medians, and
    the range over the repeats); the SQL table is checked against the report's (``report_table``)."""
    cmd, sql, full, diff = [], [], [], 0.0
    replays: dict[str, object] = {}
    for i in range(repeats):  # interleaved
        out = str(Path(tmp) / f"cmd{i}")
        replays = run_child(["--child", "command", str(run), out])[2]
        cmd.append(float(str(replays["cpu_s"])))
        sql.append(float(str(run_child(["--child", "sql", str(run)])[2]["cpu_s"])))
        res = run_child(["--child", "sql-table", str(run)])[2]
        full.append(float(str(res["cpu_s"])))
        diff = max(diff, compare_tables(report_table, res["table"]))  # type: ignore[arg-type]
    c, q, f = statistics.median(cmd), statistics.median(sql), statistics.median(full)
    return (f"{n_gpus:>3} GPUs x {hours:g} h {c:>8.2f} ({min(cmd):.1f}-{max(cmd):.1f}) "
            f"{q:>6.2f} ({min(sql):.2f}-{max(sql):.2f}) {f:>6.2f} ({min(full):.2f}-{max(full):.2f}) "
            f"{c / f:>7.1f}x {c / q:>7.1f}x {diff:>9.1e} {replays['replays']:>8} {replays['steps']:>10,} "
            f"{replays['shared']:>7} {replays['stopped']:>8}")


def print_command_rows(rows: list[str]) -> None:
    if not rows:
        return
    print()
    print("The real `gputrace report` (its what-if effects and the advice included) beside DuckDB SQL on "
          "the same store:\nthe busy column alone (ASOF JOIN + GROUP BY), and the whole phase-by-stage "
          "table the report computes\n(busy, bubble from the requests in flight, power, micro-batch: two "
          "ASOF JOINs + GROUP BY); CPU seconds\nof the call, medians (range over the repeats):")
    print(f"{'run':>16} {'report cpu s':>18} {'SQL busy s':>17} {'SQL table s':>17} {'ratio':>8} "
          f"{'(busy)':>8} {'table diff':>9} {'replays':>8} {'steps':>10} {'shared':>7} {'stopped':>8}")
    print("\n".join(rows))
    print("ratio = report / SQL table, (busy) = report / SQL busy column (the issue's target: at most 5x);\n"
          "table diff: the largest |difference| of busy or bubble fraction, SQL table against the report's;\n"
          "replays: the what-if's simulator replays per report (fit, findings' effects, advice), steps: the\n"
          "engine steps they took, shared: replays found in the session's cache instead of run again,\n"
          "stopped: replayed phases stopped once their throughput settled, of all replayed phases")


if __name__ == "__main__":
    main()
