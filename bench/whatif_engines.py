"""What-if on the real engines ([whatif] Must show 2): for SGLang and vLLM on this machine's CPU
(PP=2, dummy weights, the engine tier's model and admission limit of 8), per repeat:

1. start the engine at its defaults, run the load C = 1, 4, 16, import its log and requests;
2. diagnose, take the recommendation at C=16 (the admission limit) and fit the simulator to the
   run; predict the run with the recommendation applied;
3. restart the engine with the recommendation, run the same load, and measure.

Prints per level: measured before, predicted, measured after and the prediction's error, then per
engine the median error at C=16 and its spread over the repeats. CPU timing on a shared machine
is noisy: the spread is the figure to read beside the median.

    python bench/whatif_engines.py [--engines sglang,vllm] [--repeats 2] [--keep DIR]
    python bench/whatif_engines.py --refit DIR     # the kept runs fitted again, no engine started

Needs `make engines` (.venv-engines and the model); several minutes per engine and repeat. `--keep`
keeps each repeat's two runs (DIR/ENGINE-REPEAT/{default,applied}/run), so that a change to the
fit can be measured again on the same captures with `--refit`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from engine_servers import EngineSetting, engines_available, running_engine

from gputrace.analysis.diagnose import Finding
from gputrace.analysis.result import Analysis, analyse_store
from gputrace.store import Store
from gputrace.whatif.fit import fit_model, relative_error
from gputrace.whatif.outcome import PhaseOutcome, measured_outcomes
from gputrace.whatif.predict import finding_change, predict

LEVELS = "1,4,16"
# twice the engine tier's levels: a level's first seconds (the burst of arrivals) weigh less
LEVEL_S = {"sglang": 30.0, "vllm": 30.0}
MAX_TOKENS = {"sglang": 16, "vllm": 96}


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
        return analyse_store(store)


def _recommendation(analysis: Analysis) -> Finding:
    """The admission-limit finding at C=16 (its change names the flag and the value)."""
    for f in analysis.findings:
        if f.phase == "C=16" and f.cause == "admission_bound":
            return f
    raise SystemExit(f"no admission_bound finding at C=16: {[(f.phase, f.cause) for f in analysis.findings]}")


def one_repeat(engine_name: str, work: Path) -> list[dict[str, object]]:
    """Measure the default, apply its recommendation, measure again; the rows of :func:`compared`."""
    before = _analysis(_load_and_import(EngineSetting(engine_name, "default"), work / "default"))
    finding = _recommendation(before)
    assert finding.change is not None and finding.change.value is not None
    flag, value = finding.change.flag, finding.change.value
    applied = EngineSetting(engine_name, "applied", (flag, str(value)))
    _load_and_import(applied, work / "applied")
    return compared(engine_name, work)


def compared(engine_name: str, work: Path) -> list[dict[str, object]]:
    """The fit on ``work``/default/run, its prediction of the recommendation, and the measured
    ``work``/applied/run, per level."""
    before = _analysis(work / "default" / "run")
    finding = _recommendation(before)
    assert finding.change is not None and finding.change.value is not None
    flag, value = finding.change.flag, finding.change.value
    model = fit_model(before)
    change = finding_change(model, finding.change, finding.phase)
    assert change is not None, finding.change
    predicted = {row.label: row.predicted for row in predict(model, change)}
    after: dict[str, PhaseOutcome] = {m.label: m for m in measured_outcomes(
        _analysis(work / "applied" / "run"))}
    rows: list[dict[str, object]] = []
    for m in measured_outcomes(before):
        p, a = predicted.get(m.label), after.get(m.label)
        rows.append({"engine": engine_name, "change": f"{flag} {value}", "level": m.label,
                     "before": m.throughput_tok_s, "predicted": p.throughput_tok_s if p else None,
                     "after": a.throughput_tok_s if a else None,
                     "error": relative_error(p.throughput_tok_s if p else None,
                                             a.throughput_tok_s if a else None),
                     "band": model.uncertainty_ratio})
    return rows


def _fmt(x: object, spec: str) -> str:
    return format(x, spec) if isinstance(x, (int, float)) else "n/a"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="sglang,vllm")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    ap.add_argument("--keep", type=Path, default=None, help="keep the runs in this folder")
    ap.add_argument("--refit", type=Path, default=None,
                    help="fit the runs kept in this folder again (no engine is started)")
    args = ap.parse_args()
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
                         "(ENGINE-REPEAT/{default,applied}/run)")
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
    print("| engine | change | repeat | level | before tok/s | predicted | after (measured) | error | band |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cells = [r["engine"], r["change"], r["repeat"], r["level"], _fmt(r["before"], ".1f"),
                 _fmt(r["predicted"], ".1f"), _fmt(r["after"], ".1f"), _fmt(r["error"], "+.1%"),
                 "±" + _fmt(r["band"], ".0%")]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    for engine_name in sorted({str(r["engine"]) for r in rows}):
        mine = [r for r in rows if r["engine"] == engine_name]
        at = [r for r in mine if r["level"] == "C=16" and isinstance(r["error"], float)]
        if not at:
            continue
        errs = [float(r["error"]) for r in at]  # type: ignore[arg-type]
        print(f"{engine_name} C=16 (the recommendation's level): median error "
              f"{statistics.median(errs):+.1%}, spread {min(errs):+.1%} .. {max(errs):+.1%} "
              f"over {len(errs)} repeats")
        med = {k: statistics.median(float(r[k]) for r in at) for k in ("before", "predicted", "after")}  # type: ignore[arg-type]
        print(f"  medians over the repeats: before {med['before']:.1f}, predicted {med['predicted']:.1f}, "
              f"after {med['after']:.1f} tok/s: gain predicted x{med['predicted'] / med['before']:.2f}, "
              f"measured x{med['after'] / med['before']:.2f}")
        print(f"  {noise_line(mine)}")


def noise_line(rows: list[dict[str, object]]) -> str:
    """What the machine's noise alone moves: C=1, where neither change can act (one request is
    under every limit), before against after in each repeat; and the default's C=16 over the
    repeats (the same setting and level, minutes apart)."""
    c1 = [float(r["after"]) / float(r["before"]) - 1 for r in rows  # type: ignore[arg-type]
          if r["level"] == "C=1" and r["before"] and r["after"]]
    c16 = [float(r["before"]) for r in rows if r["level"] == "C=16" and r["before"]]  # type: ignore[arg-type]
    text = "noise:"
    if c1:
        text += (f" C=1 (the change cannot act there) after against before {min(c1):+.0%} .. "
                 f"{max(c1):+.0%};")
    if len(c16) > 1:
        text += f" the default's C=16 over the repeats {min(c16):.1f} .. {max(c16):.1f} tok/s " \
            f"({max(c16) / min(c16) - 1:.0%} apart)"
    return text

if __name__ == "__main__":
    main()
