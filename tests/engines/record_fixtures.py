"""Record tests/data/engines/<engine>-<version>-pp2/<setting>/ from real engine runs (`make
engine-fixtures`): each setting's engine is started on the CPU with PP=2, gputrace's load generator
sweeps C = 1, 4, 16 across the admission limit of 8, and the engine's log, the client's request
records, the engine's /metrics over time and the engine's arguments are kept.

    .venv/bin/python tests/engines/record_fixtures.py [--only sglang/default] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_servers import (
    FIXTURE_ONLY_SETTINGS,
    MODEL_DIR,
    REPO,
    SETTINGS,
    VERSIONS,
    EngineSetting,
    MetricsScraper,
    engines_available,
    running_engine,
    write_long_prompts,
)

FIXTURES = REPO / "tests" / "data" / "engines"
CONCURRENCY = "1,4,16"
# settings swept at other loads: interval2 at loads whose micro-batches are unequal (K = 4: C=6
# runs micro-batches of 4 and 2, C=3 of 2 and 1)
CONCURRENCY_BY_SETTING = {"interval2": "3,6", "mnbt32": "8", "kv320": "8"}
# [prefill] mnbt32: long prompts (engine_servers.write_long_prompts) of a few tokens each, through
# a step budget of 32 tokens; kv320: 64 tokens a request, so 4 requests fill the 320-token pool
MAX_TOKENS_BY_SETTING = {"mnbt32": 8, "kv320": 64}
LONG_PROMPTS = {"mnbt32"}
# SGLang logs every micro-batch of every rank (about 40-70 tok/s for one request here); vLLM is
# faster but logs its stats only every 10 s, so its levels are longer.
LEVEL_S = {"sglang": 20.0, "vllm": 30.0}
MAX_TOKENS = {"sglang": 32, "vllm": 64}


def load_argv(setting: EngineSetting, url: str, model: str, out: Path) -> list[str]:
    """The `gputrace load` command the fixture's requests come from."""
    long_prompts = Path(tempfile.gettempdir()) / "gputrace-long-prompts.jsonl"
    prompts = ["--prompts", str(write_long_prompts(long_prompts))] if setting.name in LONG_PROMPTS else []
    return [sys.executable, "-m", "gputrace", "load", "--url", url, "--model", model,
            "--concurrency", CONCURRENCY_BY_SETTING.get(setting.name, CONCURRENCY),
            "--duration-per-level", str(LEVEL_S[setting.engine]),
            "--max-tokens", str(MAX_TOKENS_BY_SETTING.get(setting.name, MAX_TOKENS[setting.engine])),
            "--ignore-eos", "--host", "client", *prompts, "--out", str(out)]


def _portable(argv: list[str]) -> list[str]:
    """Arguments with this checkout's paths replaced, so the fixture reads the same anywhere."""
    return [a.replace(str(MODEL_DIR), "MODEL_DIR").replace(str(REPO), "REPO") for a in argv]


def record(setting: EngineSetting, out_root: Path) -> Path:
    target = out_root / setting.fixture_name / setting.name
    target.mkdir(parents=True, exist_ok=True)
    log_path = target / "engine.log"
    started = time.time()
    print(f"== {setting.engine} {setting.name}: starting", flush=True)
    with running_engine(setting, log_path) as engine:
        print(f"   ready in {engine.ready_s:.0f} s on port {engine.port}", flush=True)
        argv = load_argv(setting, engine.url, engine.model, target / "requests.jsonl")
        with MetricsScraper(engine) as scraper:
            time.sleep(2.0)  # an idle stretch before the load
            load = subprocess.run(argv, capture_output=True, text=True, cwd=str(REPO))
            time.sleep(12.0 if setting.engine == "vllm" else 2.0)  # vLLM's last stats window
        final_metrics = engine.metrics_text()
    if load.returncode != 0:
        raise SystemExit(f"load failed ({load.returncode}):\n{load.stderr[-3000:]}")
    (target / "load-summary.txt").write_text(load.stdout + load.stderr)
    (target / "metrics-final.txt").write_text(final_metrics)
    with (target / "metrics.ndjson").open("w") as fh:
        for snap in scraper.snapshots:
            fh.write(json.dumps(snap, separators=(",", ":")) + "\n")
    (target / "args.json").write_text(json.dumps({
        "engine": setting.engine, "version": VERSIONS[setting.engine], "setting": setting.name,
        "engine_argv": _portable(engine.argv), "extra_args": list(setting.extra_args),
        "load_argv": _portable(argv), "recorded_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "ready_s": round(engine.ready_s, 1), "wall_s": round(time.time() - started, 1),
    }, indent=2) + "\n")
    print(f"   wrote {target} in {time.time() - started:.0f} s", flush=True)
    return target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--only", action="append", default=[],
                        help="engine/setting to record (repeatable), e.g. sglang/k16; default all")
    parser.add_argument("--out", type=Path, default=FIXTURES)
    args = parser.parse_args()
    reason = engines_available()
    if reason:
        print(f"record_fixtures: {reason}", file=sys.stderr)
        return 2
    chosen = [s for s in (*SETTINGS, *FIXTURE_ONLY_SETTINGS)
              if not args.only or f"{s.engine}/{s.name}" in args.only]
    if not chosen:
        print(f"record_fixtures: no setting matches {args.only}", file=sys.stderr)
        return 2
    for setting in chosen:
        record(setting, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
