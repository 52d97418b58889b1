"""[advisor] Must show 3 on the real engines: for SGLang and vLLM on this machine's CPU (PP=2,
dummy weights, the engine tier's model and admission limit of 8), per repeat:

1. start the engine at its defaults, run the load C = 1, 4, 16, import its log and requests;
2. fit the model to that run and take gputrace's advice (the search `gputrace report` runs);
3. restart the engine with the advised settings, run the same load, and measure, back to back.
   Where the advice is "keep", the best alternative the advice names is run instead (its
   prediction is checked the same way), and the keep itself is judged by the next repeat's
   defaults against this one's (the advice predicts no change there).

Prints per phase: measured at the defaults, predicted, measured with the change, the predicted and
measured gain and the band, and whether the measured gain lies inside it; then per engine how many
repeats lie inside the band at every phase, and the machine's own noise beside it: each phase's
spread of the defaults over the repeats (a phase "loses beyond the noise" where the change
measured below the defaults by more than that spread).

    python bench/whatif_engines.py [--engines sglang,vllm] [--repeats 5] [--keep DIR] [--quick]
    python bench/whatif_engines.py --refit DIR     # the kept runs fitted again, no engine started
    python bench/whatif_engines.py --pairs chunk,k,pool,kv [--pair-count 3] [--sweep 4096,1024,512]
                                   [--keep DIR | --refit DIR]

`--pairs` (issue 47, [prefill] Must-show 1 and 5; bench/engine_pairs.py): per case, SGLang's default
and one change with a large effect run back to back in interleaved pairs (A B A B A B), the ratio
per pair per wall second and per scheduler CPU-second, the median, and the what-if's prediction
fitted to the first default run with its band; the chunk case (long prompts, chunk 256) takes the
chunk the report advises (its finding's where the advice keeps) and sweeps others for the best
chunk measured (the sweep's first value after the first pair, the rest after the last). Each run
is a fresh engine captured by `gputrace run` (its log and /metrics): 3-4 minutes on 2 idle cores,
5-7 on the 2 cores shared at load 20-58 (the chunk case's 3 pairs and 2 sweep runs: 55 minutes).
`--keep DIR` keeps DIR/pairs-CASE/{A0,B0,...,S4096}/ (run, engine.log, cpu.json: the scheduler's
CPU counter as scraped) and case.json; a run kept there is not run again (an interrupted bench
goes on where it stopped), and `--refit DIR` prints the table from them with the fit as it is now.

Needs `make engines` (.venv-engines and the model); about 2 minutes per engine run, two runs per
engine and repeat. `--keep` keeps each repeat's two runs (DIR/ENGINE-REPEAT/{default,applied}/run
and plan.json, the change that was run), so that a change to the fit can be judged again on the
same captures with `--refit` (the prediction is then of the change that was run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from engine_pairs import (
    BAND_LIMIT,
    CASES,
    PairCase,
    RunFigures,
    figures_of,
    median,
    ratios,
    run_dirs,
    run_one,
)
from engine_servers import EngineSetting, engines_available, long_prompts_file, running_engine

from gputrace.analyse import analyse_run
from gputrace.analysis.result import Analysis
from gputrace.engines import engine_words
from gputrace.store import Store
from gputrace.whatif.advise import (
    Advice,
    AdvisedSetting,
    PhaseAdvice,
    candidates,
    changes_of,
    phases_of,
    search,
)
from gputrace.whatif.fit import FittedModel, fit_model
from gputrace.whatif.outcome import measured_outcomes

LEVELS = "1,4,16"
LEVEL_S = {"sglang": 20.0, "vllm": 20.0}  # the recorded fixtures' (tests/data/engines/)
MAX_TOKENS = {"sglang": 32, "vllm": 96}


def _load_and_import(setting: EngineSetting, work: Path) -> Path:
    """Start ``setting``, run the load, stop it; the run store of its log and requests."""
    work.mkdir(parents=True)
    engine_name = setting.engine
    log = work / "engine.log"
    with running_engine(setting, log) as engine:
        load = subprocess.run(
            [sys.executable, "-m", "gputrace", "load", "--url", engine.url, "--model", engine.model,
             "--concurrency", LEVELS, "--duration-per-level", str(LEVEL_S[engine_name]),
             "--max-tokens", str(MAX_TOKENS[engine_name]), "--ignore-eos", "--warmup", "0",
             "--out", str(work / "requests.jsonl")], capture_output=True, text=True, timeout=900)
        if load.returncode != 0:
            raise SystemExit(f"{setting}: load failed: {load.stderr[-1500:]}")
    run = work / "run"
    imp = subprocess.run(
        [sys.executable, "-m", "gputrace", "import", "--run", str(run), "--host", "engine-host",
         f"--{engine_name}-log", str(log), "--requests", str(work / "requests.jsonl"),
         "--date", time.strftime("%Y-%m-%d", time.gmtime()), "--no-progress"],
        capture_output=True, text=True, timeout=300)
    if imp.returncode != 0:
        raise SystemExit(f"{setting}: import failed: {imp.stderr[-1500:]}")
    return run


def _analysis(run: Path) -> Analysis:
    with Store.open(run, read_only=True) as store:
        return analyse_run(store, effects=False)


def advice_of(analysis: Analysis) -> tuple[Advice, FittedModel]:
    """gputrace's advice for the run, as `gputrace report` computes it (the default objective),
    and the model it was searched on."""
    model = fit_model(analysis)
    advice, _ = search(model, analysis.findings,
                       durations={pm.label: pm.duration_s for pm in analysis.metrics})
    return advice, model


def plan_of(analysis: Analysis) -> dict[str, object]:
    """What to run against the defaults: the advice; where it is "keep", the best alternative it
    names, else the findings' change its reason names (so that a prediction is still put to the
    engine: the keep itself is judged by the next repeat's defaults)."""
    advice, model = advice_of(analysis)
    if not advice.keep:
        return {"role": "advice", "changes": [c.to_dict() for c in advice.changes],
                "advice": advice.sentence()}
    if advice.alternatives:
        tried = advice.alternatives[0].changes
    else:
        findings = [change for change, origin in candidates(model, analysis.findings)
                    if origin.startswith("finding: ")]
        tried = (changes_of(model, findings[0]) or ()) if findings else ()
    return {"role": "tried beside keep" if tried else "keep", "changes": [c.to_dict() for c in tried],
            "advice": advice.sentence()}


def _flags(plan: dict[str, object]) -> tuple[str, ...]:
    out: list[str] = []
    for c in plan["changes"]:  # type: ignore[attr-defined]
        out += [str(c["flag"]), str(c["value"])]
    return tuple(out)


def one_repeat(engine_name: str, work: Path) -> list[dict[str, object]]:
    """The defaults, the advice taken from them, the advised setting run next; the rows of
    :func:`compared`."""
    before = _analysis(_load_and_import(EngineSetting(engine_name, "default"), work / "default"))
    plan = plan_of(before)
    (work / "plan.json").write_text(json.dumps(plan, indent=2) + "\n")
    running = " ".join(_flags(plan)) or "defaults"
    print(f"  {engine_name}: {plan['advice']}\n  running {plan['role']}: {running}", file=sys.stderr)
    _load_and_import(EngineSetting(engine_name, "applied", _flags(plan)), work / "applied")
    return compared(engine_name, work)


def predicted_phases(analysis: Analysis, changes: list[dict[str, object]]
                     ) -> tuple[tuple[PhaseAdvice, ...], FittedModel]:
    """The model fitted to ``analysis`` and per phase its calibrated prediction of ``changes``
    with the band it states (widened where the change leaves what the run exercised)."""
    model = fit_model(analysis)
    words = engine_words(model.params.engine)  # the advice names the engine's own setting: map it back
    change = {words.knob(str(c["knob"])): (tuple(c["value"]) if isinstance(c["value"], list) else c["value"])
              for c in changes}
    durations = {pm.label: pm.duration_s for pm in analysis.metrics}
    return phases_of(model, change, durations), model


def one_level(analysis: Analysis, label: str) -> Analysis:
    """The run as if it had measured one level only (the fit sees that phase alone)."""
    return dataclasses.replace(analysis, metrics=tuple(pm for pm in analysis.metrics if pm.label == label))


def compared(engine_name: str, work: Path) -> list[dict[str, object]]:
    """Per phase: the defaults measured, the change predicted from them (plan.json) by the fit to
    the sweep, and at the top level also by a fit to that level alone, the change measured, and
    whether the measured gain lies inside the stated band."""
    plan = json.loads((work / "plan.json").read_text())
    before = _analysis(work / "default" / "run")
    after = {m.label: m.throughput_tok_s for m in measured_outcomes(_analysis(work / "applied" / "run"))}
    text = ", ".join(AdvisedSetting(**c).text() for c in plan["changes"]) or "none"
    top = max(before.metrics, key=lambda pm: pm.target_concurrency or 0).label
    fits = [("sweep", before), (f"{top} alone", one_level(before, top))]
    rows: list[dict[str, object]] = []
    for fit_name, fitted in fits:
        predicted, model = predicted_phases(fitted, plan["changes"])
        phases = {p.phase: p for p in predicted}
        for m in measured_outcomes(fitted):
            p, a = phases.get(m.label), after.get(m.label)
            row: dict[str, object] = {"engine": engine_name, "role": plan["role"], "change": text,
                                      "fit": fit_name, "level": m.label, "before": m.throughput_tok_s,
                                      "after": a, "predicted": p.predicted_tok_s if p else None,
                                      "band": p.band_ratio if p else None,
                                      "keep_band": model.band_ratio(m.label)}
            if p and a and m.throughput_tok_s:
                row["predicted_gain"] = p.gain_ratio
                row["measured_gain"] = a / m.throughput_tok_s - 1
                row["inside"] = abs(row["measured_gain"] - p.gain_ratio) <= p.band_ratio  # type: ignore[operator]
            rows.append(row)
    return rows


def _fmt(x: object, spec: str) -> str:
    return format(x, spec) if isinstance(x, (int, float)) else "n/a"


# --pairs (issue 47): one change against the defaults in interleaved pairs

PREFILL_CAUSE = "prefill_budget"


@dataclasses.dataclass(frozen=True, slots=True)
class ChosenChange:
    """What the default run's report says, and the value run against it (case.json)."""

    advice: str
    prefill_cause: tuple[str, ...]  # the prefill_budget findings: "phase: recommendation"
    names_the_flag: bool  # a prefill_budget finding's change is the case's flag
    changed: int
    source: str  # "the case", "the advice", "the finding (the advice keeps)"


def chosen_change(case: PairCase, analysis: Analysis) -> ChosenChange:
    """The case's own value, or (the chunk case) the chunk the advice names, else its finding's."""
    advice, _ = advice_of(analysis)
    named = [f for f in analysis.findings if f.cause == PREFILL_CAUSE]
    said = (advice.sentence(), tuple(f"{f.phase}: {f.recommendation}" for f in named),
            any(f.change is not None and f.change.flag == case.flag for f in named))
    if case.changed_value is not None:
        return ChosenChange(*said, case.changed_value, "the case")
    advised = [int(c.value) for c in advice.changes if c.flag == case.flag]
    to_measure = [int(c.value) for c in advice.to_measure if c.flag == case.flag]
    found = [int(f.change.value) for f in named if f.change is not None and f.change.flag == case.flag]
    if advised:
        return ChosenChange(*said, advised[0], "the advice")
    if to_measure:
        return ChosenChange(*said, to_measure[0], "the advice (to rerun and measure: it cannot price it)")
    if found:
        return ChosenChange(*said, found[0], "the finding (the advice keeps)")
    raise SystemExit(f"{case.name}: the default run's report names no {case.flag}: {advice.sentence()}")


def measure_pairs(case: PairCase, work: Path, count: int, sweep: tuple[int, ...]) -> None:
    """A0, then the change taken from it, then B0 A1 B1 ... back to back; the sweep's first value
    after the first pair, the rest after the last."""
    prompts = long_prompts_file(work.parent / "long-prompts.jsonl") if case.long_prompts else None
    t0 = time.monotonic()
    run_one(case, case.default_value, work / "A0", prompts)
    chosen = chosen_change(case, _analysis(work / "A0" / "run"))
    (work / "case.json").write_text(json.dumps(dataclasses.asdict(chosen), indent=2) + "\n")
    print(f"{case.name}: A0 done ({time.monotonic() - t0:.0f} s); running {case.flag} {chosen.changed} "
          f"from {chosen.source}", file=sys.stderr)
    # the sweep runs after the first pair, so that a bench cut short on a slow machine has the
    # best chunk measured beside one pair at least
    sweep_runs = [v for v in sweep if v != chosen.changed] if case.long_prompts else []
    for i in range(count):
        if i:
            run_one(case, case.default_value, work / f"A{i}", prompts)
        run_one(case, chosen.changed, work / f"B{i}", prompts)
        print(f"{case.name}: pair {i} done ({time.monotonic() - t0:.0f} s)", file=sys.stderr)
        while sweep_runs and (i == 0 or i == count - 1):
            value = sweep_runs.pop(0)
            run_one(case, value, work / f"S{value}", prompts)
            print(f"{case.name}: sweep {value} done ({time.monotonic() - t0:.0f} s)", file=sys.stderr)
            if i == 0:
                break


@dataclasses.dataclass(frozen=True, slots=True)
class Prediction:
    ratio: float  # predicted / measured at the default
    band_ratio: float


@dataclasses.dataclass(frozen=True, slots=True)
class PairsResult:
    case: PairCase
    chosen: ChosenChange
    pairs: list[tuple[RunFigures, RunFigures]]
    sweep: list[RunFigures]
    predictions: dict[int, Prediction]  # by value: the fit to A0


def pairs_result(case: PairCase, work: Path) -> PairsResult:
    """The kept runs of one case read back (what --refit reads): figures and the prediction of
    each value run, fitted to the first default run."""
    kept = json.loads((work / "case.json").read_text())
    chosen = ChosenChange(**{**kept, "prefill_cause": tuple(kept["prefill_cause"])})
    runs = run_dirs(work)
    changed = chosen.changed
    pairs = [(figures_of(case, case.default_value, runs[f"A{i}"]), figures_of(case, changed, runs[f"B{i}"]))
             for i in range(len(runs)) if f"A{i}" in runs and f"B{i}" in runs]
    sweep = [figures_of(case, int(name[1:]), d) for name, d in runs.items() if name.startswith("S")]
    before = _analysis(runs["A0"] / "run")
    predictions = {}
    for value in sorted({changed, *(f.value for f in sweep)}):
        phases, _ = predicted_phases(before, [{"knob": case.knob, "value": value}])
        (p,) = [p for p in phases if p.phase == f"C={case.concurrency}"]
        predictions[value] = Prediction(1.0 + p.gain_ratio, p.band_ratio)
    return PairsResult(case, chosen, pairs, sorted(sweep, key=lambda f: f.value), predictions)


def _within(predicted: float, measured: float) -> str:
    return "yes" if abs(predicted / measured - 1.0) <= BAND_LIMIT else "NO"


def _inside(predicted: Prediction, measured: float) -> str:
    return "yes" if abs(measured - predicted.ratio) <= predicted.band_ratio else "NO"


def print_pairs(results: list[PairsResult]) -> None:
    """Per case the pairs, the medians and the prediction; the chunk case's sweep; then how many
    predictions lie within 25 % of the measured medians."""
    judged: list[tuple[str, str, str]] = []
    for r in results:
        c, changed = r.case, r.chosen.changed
        prompts = "prompts of 950-1,900 tokens" if c.long_prompts else "the load's default prompts"
        print(f"\n## {c.name}: {c.flag} {c.default_value} -> {changed} ({r.chosen.source}); "
              f"flags {' '.join(c.base_flags) or 'the tier defaults'}; closed loop C={c.concurrency}, "
              f"{prompts}, max_tokens {c.max_tokens}, {c.level_s:.0f} s a run after "
              f"{c.warmup_s:.0f} s of warm-up\n")
        print(f"default run's advice: {r.chosen.advice}")
        if c.long_prompts:  # Must-show 1: the report names the prefill cause with the case's flag
            print(f"prefill cause named: {'; '.join(r.chosen.prefill_cause) or 'none'} "
                  f"(names {c.flag}: {'yes' if r.chosen.names_the_flag else 'no'})")
        print()
        print("| pair | default tok/s | changed tok/s | ratio | default CPU-s | changed CPU-s | "
              "default tok/CPU-s | changed tok/CPU-s | ratio per CPU-s |")
        print("|---|---|---|---|---|---|---|---|---|")
        for i, (a, b) in enumerate(r.pairs):
            print(f"| {i} | {a.tok_s:.2f} | {b.tok_s:.2f} | x{b.tok_s / a.tok_s:.2f} | {a.cpu_s:.1f} | "
                  f"{b.cpu_s:.1f} | {a.tok_per_cpu_s:.3f} | {b.tok_per_cpu_s:.3f} | "
                  f"x{b.tok_per_cpu_s / a.tok_per_cpu_s:.2f} |")
        wall, cpu = ratios(r.pairs)
        p, mw, mc = r.predictions[changed], median(wall), median(cpu)
        print(f"\nmedian ratio x{mw:.2f} per wall second, x{mc:.2f} per scheduler CPU-second")
        print(f"predicted (fit to A0) x{p.ratio:.2f}, band ±{p.band_ratio:.0%}: within {BAND_LIMIT:.0%} "
              f"of the measured median: per wall second {_within(p.ratio, mw)}, per CPU-second "
              f"{_within(p.ratio, mc)}; the measured inside the stated band: {_inside(p, mw)} (wall), "
              f"{_inside(p, mc)} (CPU)")
        judged.append((c.name, _within(p.ratio, mw), _within(p.ratio, mc)))
        if r.sweep:
            print_sweep(r, mw, mc)
    print(f"\npredicted within {BAND_LIMIT:.0%} of the measured median ratio: per wall second "
          f"{sum(w == 'yes' for _, w, _ in judged)} of {len(judged)}, per scheduler CPU-second "
          f"{sum(x == 'yes' for _, _, x in judged)} of {len(judged)} ("
          + ", ".join(f"{n} {w}/{x}" for n, w, x in judged) + ")")


def print_sweep(r: PairsResult, advised_wall: float, advised_cpu: float) -> None:
    """Each value run (the advised one by its pairs' median) against the defaults' median; the
    best measured, and whether the advised one gains within 25 % of it."""
    c, changed = r.case, r.chosen.changed
    base_tok = median([a.tok_s for a, _ in r.pairs])
    base_cpu = median([a.tok_per_cpu_s for a, _ in r.pairs])
    rows = [(changed, advised_wall * base_tok, advised_cpu * base_cpu)]
    rows += [(f.value, f.tok_s, f.tok_per_cpu_s) for f in r.sweep]
    print(f"\n| {c.flag} | tok/s | ratio to the defaults' median | tok/CPU-s | ratio per CPU-s | "
          "predicted | band |")
    print("|---|---|---|---|---|---|---|")
    for value, tok, per_cpu in sorted(rows):
        q = r.predictions[value]
        print(f"| {value}{' (the pairs)' if value == changed else ''} | {tok:.2f} | x{tok / base_tok:.2f} | "
              f"{per_cpu:.3f} | x{per_cpu / base_cpu:.2f} | x{q.ratio:.2f} | ±{q.band_ratio:.0%} |")
    best = max(rows, key=lambda row: row[1])
    best_cpu = max(rows, key=lambda row: row[2])
    wall_ok = advised_wall >= (1 - BAND_LIMIT) * best[1] / base_tok
    cpu_ok = advised_cpu >= (1 - BAND_LIMIT) * best_cpu[2] / base_cpu
    print(f"\nbest {c.flag} measured: {best[0]} (x{best[1] / base_tok:.2f}) per wall second, "
          f"{best_cpu[0]} (x{best_cpu[2] / base_cpu:.2f}) per CPU-second; the advised {changed} gains "
          f"x{advised_wall:.2f} / x{advised_cpu:.2f}: within {BAND_LIMIT:.0%} of the best: per wall "
          f"second {'yes' if wall_ok else 'NO'}, per CPU-second {'yes' if cpu_ok else 'NO'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="sglang,vllm")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true",
                    help="small inputs, one repeat: the users' code path (tests/test_bench_quick.py)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    ap.add_argument("--keep", type=Path, default=None, help="keep the runs in this folder")
    ap.add_argument("--refit", type=Path, default=None,
                    help="fit the runs kept in this folder again (no engine is started)")
    ap.add_argument("--pairs", default=None,
                    help=f"interleaved pairs of these SGLang cases ({','.join(CASES)}) instead of the advice")
    ap.add_argument("--pair-count", type=int, default=3)
    ap.add_argument("--sweep", default="4096,1024,512",
                    help="with --pairs chunk: the other chunks run once each, for the best chunk measured")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.pairs is not None:
        names = [n for n in args.pairs.split(",") if n]
        unknown = [n for n in names if n not in CASES]
        if unknown:
            raise SystemExit(f"--pairs: unknown case(s) {', '.join(unknown)} (known: {', '.join(CASES)})")
        sweep = tuple(int(v) for v in args.sweep.split(",") if v)
        if args.refit is None:
            reason = engines_available()
            if reason is not None:
                print(f"skipped: {reason}")
                return
            work = args.keep or Path(tempfile.mkdtemp(prefix="engine-pairs-"))
            for name in names:
                measure_pairs(CASES[name], work / f"pairs-{name}", args.pair_count, sweep)
        results = [pairs_result(CASES[n], (args.refit or work) / f"pairs-{n}") for n in names]
        print_pairs(results)
        return
    if args.quick:
        args.engines, args.repeats = "sglang", 1
    # SIGTERM ends the bench as Ctrl-C does: the running engine's context stops its process group
    engines = [e for e in args.engines.split(",") if e]
    rows = refit(args.refit, engines) if args.refit is not None else measure(engines, args.repeats, args.keep)
    if rows is None:
        return
    print_rows(rows)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


def refit(kept: Path, engines: list[str]) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for work in sorted(kept.iterdir()):
        engine_name, _, rep = work.name.rpartition("-")
        if engine_name in engines and (work / "applied" / "run").exists():
            got = compared(engine_name, work)
            for r in got:
                r["repeat"] = int(rep)
            rows += got
    if not rows:
        raise SystemExit(f"no kept runs of {','.join(engines)} in {kept} "
                         "(ENGINE-REPEAT/{default,applied}/run and plan.json)")
    return rows


def measure(engines: list[str], repeats: int, keep: Path | None) -> list[dict[str, object]] | None:
    reason = engines_available()
    if reason is not None:  # `make bench` runs every bench: without the engines this one skips
        print(f"skipped: {reason}")
        return None
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="whatif-engines-") as tmp:
        where = keep if keep is not None else Path(tmp)
        for rep in range(repeats):  # the engines take turns: a slow spell of the machine hits both
            for engine_name in engines:
                t0 = time.monotonic()
                got = one_repeat(engine_name, where / f"{engine_name}-{rep}")
                for r in got:
                    r["repeat"] = rep
                rows += got
                print(f"{engine_name} repeat {rep}: {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return rows


def print_rows(rows: list[dict[str, object]]) -> None:
    print("| engine | repeat | run | change | fit | level | defaults tok/s | predicted | measured | "
          "gain predicted | gain measured | band | inside |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cells = [r["engine"], r["repeat"], r["role"], r["change"], r["fit"], r["level"],
                 _fmt(r["before"], ".1f"),
                 _fmt(r["predicted"], ".1f"), _fmt(r["after"], ".1f"), _fmt(r.get("predicted_gain"), "+.0%"),
                 _fmt(r.get("measured_gain"), "+.0%"), "±" + _fmt(r["band"], ".0%"),
                 {True: "yes", False: "NO"}.get(bool(r["inside"])) if "inside" in r else "n/a"]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    for engine_name in sorted({str(r["engine"]) for r in rows}):
        print()
        for line in summary(engine_name, [r for r in rows if r["engine"] == engine_name]):
            print(line)


def noise(rows: list[dict[str, object]]) -> dict[str, float]:
    """Per phase, the defaults' own spread over the repeats (max / min - 1): the same setting and
    load minutes apart on this machine."""
    out = {}
    for level in dict.fromkeys(str(r["level"]) for r in rows):
        seen = [float(r["before"]) for r in rows if r["level"] == level and r["before"]]  # type: ignore[arg-type]
        if len(seen) > 1:
            out[level] = max(seen) / min(seen) - 1
    return out


def summary(engine_name: str, rows: list[dict[str, object]]) -> list[str]:
    """Per engine: per fit, the repeats inside the band at every phase; the phases that lost beyond
    the noise; where the advice was keep, the next repeat's defaults against this one's."""
    sweep = [r for r in rows if r["fit"] == "sweep"]
    spread = noise(sweep)
    repeats = sorted({int(str(r["repeat"])) for r in rows})
    runs = sorted({f"{r['role']}: {r['change']}" for r in rows})
    lines = [f"{engine_name}: ran {'; '.join(runs)}"]
    for fit_name in dict.fromkeys(str(r["fit"]) for r in rows):
        by_rep = {k: [r for r in rows if r["repeat"] == k and r["fit"] == fit_name] for k in repeats}
        inside = [k for k, rs in by_rep.items() if rs and all(r.get("inside") is True for r in rs)]
        lines.append(f"  fit to {fit_name}: measured gain inside the stated band at every phase in "
                     f"{len(inside)} of {len(by_rep)} repeats")
    lost = [(r["repeat"], str(r["level"]), float(g)) for r in sweep  # type: ignore[arg-type]
            if (g := r.get("measured_gain")) is not None and float(g) < -spread.get(str(r["level"]), 0.0)]  # type: ignore[arg-type]
    lines += ["  the defaults' own spread over the repeats (the noise): "
              + (", ".join(f"{k} {v:.0%}" for k, v in spread.items()) or "n/a (one repeat)"),
              "  phases the change measured below the defaults by more than that noise: "
              + (", ".join(f"repeat {k} {lv} {g:+.0%}" for k, lv, g in lost) or "none")]
    by_rep = {k: [r for r in sweep if r["repeat"] == k] for k in repeats}
    for k, rs in by_rep.items():
        nxt = by_rep.get(k + 1)
        if not rs or "keep" not in str(rs[0]["role"]) or not nxt:
            continue
        band = {str(r["level"]): float(r["keep_band"]) for r in rs}  # type: ignore[arg-type]
        moved = {str(a["level"]): float(b["before"]) / float(a["before"]) - 1  # type: ignore[arg-type]
                 for a, b in zip(rs, nxt, strict=False) if a["before"] and b["before"]}
        ok = all(abs(g) <= band[lv] for lv, g in moved.items())
        lines.append(f"  keep (repeat {k}): the next repeat's defaults against this one's "
                     + ", ".join(f"{lv} {g:+.0%} (band ±{band[lv]:.0%})" for lv, g in moved.items())
                     + (": inside" if ok else ": OUTSIDE"))
    return lines


if __name__ == "__main__":
    main()
