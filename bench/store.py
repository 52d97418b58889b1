"""Run-store throughput: GpuSample rows appended (batches of 1,000, 100,000 and 1,000,000) and read
back as columns, beside numpy.save / numpy.load of the same arrays in the same run.

    python bench/store.py [--rows N] [--repeats R] [--quick]

Prints medians. The reference (numpy) writes the same columns to .npy files without any
database, so the ratio is the price of a queryable, crash-safe store.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from gputrace.model import GpuSample
from gputrace.store import Store


def make_columns(n_rows: int, n_gpus: int = 8) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "gpu_index": np.arange(n_rows, dtype=np.int64) % n_gpus,
        "ts_ns": 1_764_486_000_000_000_000 + np.arange(n_rows, dtype=np.int64) * 12_500_000,
        "utilization_ratio": rng.random(n_rows),
        "memory_utilization_ratio": rng.random(n_rows),
        "power_w": 60 + 290 * rng.random(n_rows),
        "pcie_tx_bytes_per_s": rng.random(n_rows) * 1e9,
        "pcie_rx_bytes_per_s": rng.random(n_rows) * 1e9,
        "sm_clock_hz": np.full(n_rows, 1.98e9),
        "temperature_c": 40 + 30 * rng.random(n_rows),
        "seq": np.arange(n_rows, dtype=np.int64),
    }


def slice_columns(cols: dict[str, np.ndarray], start: int, stop: int) -> dict[str, object]:
    # The collector appends one host's batch at a time, so the host is a constant column.
    return {"host": "node0", **{k: v[start:stop] for k, v in cols.items()}}


def slice_columns_raw(cols: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
    return {k: v[:rows] for k, v in cols.items()}


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_store_append(cols: dict[str, np.ndarray], batch: int, root: Path) -> float:
    n = len(cols["ts_ns"])
    with Store.create(root / f"run-{time.monotonic_ns()}") as store:
        def go() -> None:
            for start in range(0, n, batch):
                store.append_columns("gpu_samples", slice_columns(cols, start, start + batch))
        return timed(go)


def bench_records_append(n: int, batch: int, root: Path) -> float:
    rows = [GpuSample(host="node0", gpu_index=i % 8, ts_ns=i, utilization_ratio=0.5, power_w=100.0)
            for i in range(n)]
    with Store.create(root / f"rec-{time.monotonic_ns()}") as store:
        def go() -> None:
            for start in range(0, n, batch):
                store.append(rows[start:start + batch])
        return timed(go)


def bench_numpy_save(cols: dict[str, np.ndarray], batch: int, root: Path) -> float:
    n = len(cols["ts_ns"])
    out = root / f"npy-{time.monotonic_ns()}"
    out.mkdir()

    def go() -> None:
        for i, start in enumerate(range(0, n, batch)):
            part = slice_columns(cols, start, start + batch)
            for name, arr in part.items():
                if isinstance(arr, np.ndarray):
                    np.save(out / f"{name}-{i}.npy", arr)
    return timed(go)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true",
                        help="small inputs, one repeat: the users' code path (tests/test_bench_quick.py)")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.repeats = 20_000, 1
    n = args.rows
    cols = make_columns(n)
    print(f"GpuSample rows: {n:,}; {len(cols)} columns given; medians of {args.repeats} runs")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        # DuckDB scans an appended Arrow batch on one thread per ~122,880 rows: batches of 1,000,000
        # use both cores, batches of 100,000 one.
        for batch in (1_000, 100_000, 1_000_000):
            rows = min(n, 200_000) if batch == 1_000 else n  # 1,000-row batches: a sample suffices
            part = slice_columns_raw(cols, rows)
            store_s = [bench_store_append(part, batch, root) for _ in range(args.repeats)]
            npy_s = [bench_numpy_save(part, batch, root) for _ in range(args.repeats)]
            s, r = statistics.median(store_s), statistics.median(npy_s)
            print(f"append, batches of {batch:>9,}: store {rows / s:>12,.0f} rows/s   "
                  f"numpy.save {rows / r:>12,.0f} rows/s   store/numpy {r / s:.2f}x")
        rec_n = min(n, 200_000)
        rec_s = statistics.median(bench_records_append(rec_n, 100_000, root)
                                  for _ in range(args.repeats))
        print(f"append records (dataclasses), batches of 100,000: {rec_n / rec_s:,.0f} rows/s")

        with Store.create(root / "read") as store:
            store.append_columns("gpu_samples", slice_columns(cols, 0, n))
            read_s = statistics.median(timed(lambda: store.columns("gpu_samples"))
                                       for _ in range(args.repeats))
        npy_dir = root / "read-npy"
        npy_dir.mkdir()
        for name, arr in cols.items():
            np.save(npy_dir / f"{name}.npy", arr)

        def load_all() -> None:
            for name in cols:
                np.load(npy_dir / f"{name}.npy")
        load_s = statistics.median(timed(load_all) for _ in range(args.repeats))
        print(f"read back as columns: store {n / read_s:>12,.0f} rows/s   numpy.load "
              f"{n / load_s:>12,.0f} rows/s   store/numpy {load_s / read_s:.2f}x "
              "(store reads all 22 columns, numpy only the 10 arrays written)")
    print("target: >= 1,000,000 rows/s appended in large batches")


if __name__ == "__main__":
    main()
