"""The simulator against the measurements that motivated gputrace ([sim] Must show 2).

    python bench/sim.py --calibration [--fit]      (or python bench/calibration.py [--fit])

Kimi K2.6 (a large MoE model) served by SGLang with PP8 on 8 PCIe GPUs, max_running_requests
64; each level sent its C requests at once and measured all tokens over the wall time until the
last one finished (a burst, the simulator's client_mode "burst"). Each figure is simulated with
the same settings and printed beside the measurement, with the ratio; a figure off by more than
15 % is marked. Without --fit the simulator's default (dense) cost model runs; --fit searches a
small grid of the MoE cost model (Kimi K2's 384 routed experts, top-8: the step's memory time
grows with the distinct experts its tokens touch) plus a per-token compute cost and prints the
best fit. Nothing about the scheduler is fitted. Prompt length is not in the measurements: 128
tokens is assumed.
"""

from __future__ import annotations

import argparse
import itertools
import time
from dataclasses import dataclass
from typing import Any

from gputrace.sim.params import scenario_params
from gputrace.sim.run import run_params

TOLERANCE = 0.15


@dataclass(frozen=True)
class Figure:
    label: str
    concurrency: int
    k: int | None  # None: SGLang's default 64 // 8 = 8
    max_tokens: int
    measured_tok_s: float
    output_jitter: float = 0.0  # the 2048-token runs ended at about 1,900-1,940 tokens per request


FIGURES = (
    Figure("C=1 K=8 512 tok", 1, None, 512, 34.3),
    Figure("C=1 K=64 512 tok", 1, 64, 512, 37.0),
    Figure("C=32 K=8 512 tok", 32, None, 512, 248.0),
    Figure("C=8 K=64 4096 tok", 8, 64, 4096, 83.0),
    Figure("C=32 K=64 4096 tok", 32, 64, 4096, 250.9),
    Figure("C=48 K=64 4096 tok", 48, 64, 4096, 316.2),
    Figure("C=32 K=64 2048 tok", 32, 64, 2048, 187.7, 0.1),
    Figure("C=64 K=64 2048 tok", 64, 64, 2048, 396.0, 0.1),
)


def simulate(fig: Figure, cost: dict[str, Any]) -> float:
    params = scenario_params("motivating", {
        **cost, "client_mode": "burst", "concurrency": (fig.concurrency,), "max_tokens": fig.max_tokens,
        "output_tokens_jitter": fig.output_jitter, "pp_max_micro_batch_size": fig.k, "phase_s": 600.0,
        "drain_s": 0.0, "input_tokens": 128, "seed": 0})
    phase = run_params(params).ground_truth["phases"][0]
    return float(phase["throughput_tok_s"])


def table(cost: dict[str, Any]) -> tuple[list[tuple[Figure, float]], float]:
    rows = [(fig, simulate(fig, cost)) for fig in FIGURES]
    worst = max(abs(sim / fig.measured_tok_s - 1) for fig, sim in rows)
    return rows, worst


def show(title: str, cost: dict[str, Any], rows: list[tuple[Figure, float]]) -> None:
    print(title)
    print("  " + ", ".join(f"{k}={v}" for k, v in cost.items()) if cost else "  (the default parameters)")
    print(f"  {'figure':<22} {'measured':>9} {'simulated':>10} {'ratio':>7}")
    for fig, sim in rows:
        ratio = sim / fig.measured_tok_s
        flag = "" if abs(ratio - 1) <= TOLERANCE else "   <- off by more than 15 %"
        print(f"  {fig.label:<22} {fig.measured_tok_s:9.1f} {sim:10.1f} {ratio:7.2f}{flag}")


MOE_GRID = {
    "weight_read_s": (0.0015, 0.0025, 0.0035),
    "expert_read_s": (0.01, 0.02, 0.03),
    "decode_token_s": (0.00005, 0.0001, 0.0002),
}


def fit() -> tuple[dict[str, Any], list[tuple[Figure, float]], float]:
    best: tuple[dict[str, Any], list[tuple[Figure, float]], float] | None = None
    for values in itertools.product(*MOE_GRID.values()):
        cost = {"moe_experts": 384, "moe_top_k": 8, **dict(zip(MOE_GRID, values, strict=True))}
        rows, worst = table(cost)
        if best is None or worst < best[2]:
            best = (cost, rows, worst)
    assert best is not None
    return best


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", action="store_true", help="also search the MoE cost model's grid")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows, worst = table({})
    show("default (dense) cost model", {}, rows)
    print(f"  worst: {worst:.0%} off")
    if args.fit:
        cost, rows, worst = fit()
        show(f"\nbest of {len(list(itertools.product(*MOE_GRID.values())))} MoE cost models "
             "(384 experts, top-8)", cost, rows)
        print(f"  worst: {worst:.0%} off")
    print("\nWhy C=32 K=8 resists: its C requests spread over 4 micro-batches of 8 (K caps each; the "
          "pool of 64 holds all 32), so 8 stages each run 4 steps of 8 per cycle; 248 tok/s then "
          "needs a step of about 16 ms at batch 8, against 3.4 ms at batch 1 (C=1) and about 16 ms "
          "at batch 32 (C=32 K=64, one micro-batch): a step that costs the same at 8 and 32 tokens. "
          "The distinct experts 8 and 32 tokens touch differ by a factor of 3 (62 against 196 of "
          "384 at top-8).")
    print("Why the two C=32 K=64 figures resist together: 250.9 tok/s with max_tokens 4096 against "
          "187.7 with 2048, the same deployment and level; a model whose step grows with the "
          "context (or stays flat) cannot make the longer burst faster, so at most one of them "
          "fits: the runs differed in something the figures do not say.")
    print(f"({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
