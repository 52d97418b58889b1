"""Real serving engines (SGLang, vLLM) started on this machine's CPU with PP=2, for the engine tier
and for recording the fixtures in tests/data/engines/. The environment is `.venv-engines` (made by
`make engines`); each engine runs in its own process group on 127.0.0.1 and is stopped by group."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from helpers import free_port

REPO = Path(__file__).resolve().parents[1]
ENGINES_VENV = Path(os.environ.get("GPUTRACE_ENGINES_VENV", REPO / ".venv-engines"))
MODEL_DIR = ENGINES_VENV / "model"
READY_TIMEOUT_S = 420.0  # SGLang is ready in about 60 s here, vLLM in about 90 s; CI shares the cores
VERSIONS = {"sglang": "0.5.23", "vllm": "0.32.0"}
PP_SIZE = 2
ADMISSION_LIMIT = 8  # max_running_requests / max_num_seqs at the default setting
# What each engine logs once it has served its own warm-up request: the test's counters start after.
READY_LINES = {"sglang": "The server is fired up and ready to roll", "vllm": "Application startup complete"}


@dataclass(frozen=True, slots=True)
class EngineSetting:
    """One way to start an engine: a name for the fixture folder and the flags beyond the base."""

    engine: str  # "sglang" | "vllm"
    name: str  # "default", "k16", ...
    extra_args: tuple[str, ...] = ()

    @property
    def fixture_name(self) -> str:
        return f"{self.engine}-{VERSIONS[self.engine]}-pp{PP_SIZE}"


# The settings the fixtures are recorded at: the defaults, and the change each engine invites.
SETTINGS: tuple[EngineSetting, ...] = (
    EngineSetting("sglang", "default"),
    EngineSetting("sglang", "k16", ("--pp-max-micro-batch-size", "16")),
    EngineSetting("vllm", "default"),
    EngineSetting("vllm", "seqs4", ("--max-num-seqs", "4")),
)
# Recorded as fixtures only (tests/engines/record_fixtures.py), not run by the engine tier: the
# log sampled every 2nd step at loads whose micro-batches are unequal (C=6: 4 and 2).
PREFILL_MAX_NUM_SEQS = 16  # [prefill] rows to spare at C=8: what waits, waits for the step budget


def prefill_budget_setting(budget: int) -> EngineSetting:
    """[prefill] vLLM with a step budget of ``budget`` tokens (it logs "Chunked prefill is enabled
    with max_num_batched_tokens=N") and rows to spare, for long prompts (write_long_prompts)."""
    return EngineSetting("vllm", f"mnbt{budget}", ("--max-num-batched-tokens", str(budget),
                                                   "--max-num-seqs", str(PREFILL_MAX_NUM_SEQS)))


FIXTURE_ONLY_SETTINGS = (EngineSetting("sglang", "interval2", ("--decode-log-interval", "2")),
                         prefill_budget_setting(32),
                         # [prefill] Must show 5's KV case: a 320-token pool under C=8 (about 34-token
                         # prompts, 64 tokens out), where admission binds on KV
                         EngineSetting("sglang", "kv320", ("--max-total-tokens", "320")))
LONG_PROMPT_WORDS = (140, 180)  # about 270-350 tokens of the tiny model's (1.85 a word), under 512
_WORDS = ("time", "year", "people", "way", "day", "man", "thing", "woman", "life", "child", "world",
          "school", "state", "family", "student", "group", "country", "problem", "hand", "part",
          "place", "case", "week", "company", "system", "program", "question", "work", "government",
          "number", "night", "point", "home", "water", "room", "mother", "area", "money", "story",
          "fact", "month", "lot", "right", "study", "book", "eye", "job", "word", "business", "issue",
          "side", "kind", "head", "house", "service", "friend", "father", "power", "hour", "game",
          "line", "end", "member", "law", "car", "city", "community", "name", "president", "team")


def write_long_prompts(path: Path, n: int = 1000, seed: int = 47) -> Path:
    """``n`` different prompts of random words (`gputrace load --prompts`), each opening with its
    own number: no two share a prefix block, so vLLM's prefix cache saves none of their prefill."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(n):
            words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(*LONG_PROMPT_WORDS)))
            f.write(json.dumps({"prompt": f"{i} {rng.random():.6f} {words}"}) + "\n")
    return path


def engines_available() -> str | None:
    """None when .venv-engines and its model are there, else the reason they are not."""
    python = ENGINES_VENV / "bin" / "python"
    if not python.exists():
        return f"{ENGINES_VENV} is absent: run `make engines`"
    if not (MODEL_DIR / "config.json").exists():
        return f"{MODEL_DIR} has no model: run `make engines`"
    return None


def engine_tier_missing() -> str | None:
    """None when everything the engine tier needs is here, else one line naming all that is
    missing. Checked before any engine starts: an engine takes a minute or two to be ready, and
    the tier once started both and then skipped every test for want of Prometheus."""
    missing = [reason for reason in (
        engines_available(),
        None if shutil.which("prometheus")
        else "no `prometheus` on PATH (apt-get install prometheus: see .ci/run)",
    ) if reason is not None]
    return "the engine tier needs: " + "; ".join(missing) if missing else None


def require_engine_tier() -> None:
    """Skip the calling test where the engine tier's needs are missing; fail instead where
    GPUTRACE_REQUIRE_ENGINE_TESTS=1 (CI's engine job, which must not pass by skipping)."""
    import pytest

    reason = engine_tier_missing()
    if reason is None:
        return
    if os.environ.get("GPUTRACE_REQUIRE_ENGINE_TESTS") == "1":
        pytest.fail(reason + "; GPUTRACE_REQUIRE_ENGINE_TESTS=1 makes this a failure")
    pytest.skip(reason)


def _without_flag(args: list[str], flag: str) -> list[str]:
    """``args`` less ``flag`` and its value, so a setting's own value wins."""
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        else:
            out.append(arg)
    return out


def engine_command(setting: EngineSetting, port: int) -> tuple[list[str], dict[str, str]]:
    """The argv and environment that start ``setting`` on ``port``."""
    python = str(ENGINES_VENV / "bin" / "python")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    for name in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
        env.pop(name, None)
    if setting.engine == "sglang":
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "0|1"
        base = ["--model-path", str(MODEL_DIR), "--device", "cpu", "--load-format", "dummy",
                "--pp-size", str(PP_SIZE), "--attention-backend", "torch_native",
                "--sampling-backend", "pytorch", "--grammar-backend", "none",
                "--max-total-tokens", "16384", "--context-length", "512", "--enable-metrics",
                "--decode-log-interval", "1", "--max-running-requests", str(ADMISSION_LIMIT),
                "--host", "127.0.0.1", "--port", str(port)]
        argv = [python, "-m", "sglang.launch_server"]
    elif setting.engine == "vllm":
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
        base = ["--model", str(MODEL_DIR), "--load-format", "dummy",
                "--pipeline-parallel-size", str(PP_SIZE), "--max-num-seqs", str(ADMISSION_LIMIT),
                "--max-model-len", "512", "--host", "127.0.0.1", "--port", str(port)]
        argv = [python, "-m", "vllm.entrypoints.openai.api_server"]
    else:
        raise ValueError(f"unknown engine {setting.engine!r}")
    for i in range(0, len(setting.extra_args), 2):
        base = _without_flag(base, setting.extra_args[i])
    return [*argv, *base, *setting.extra_args], env


@dataclass
class RunningEngine:
    setting: EngineSetting
    port: int
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes]
    model: str = ""
    ready_s: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metrics_text(self, timeout_s: float = 5.0) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=timeout_s) as resp:
            return str(resp.read().decode())


def _get_json(url: str, timeout_s: float = 5.0) -> object:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def _wait_ready(engine: RunningEngine, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if engine.proc.poll() is not None:
            tail = engine.log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{engine.setting.engine} exited with {engine.proc.returncode}:\n{tail}")
        try:
            models = _get_json(f"{engine.url}/v1/models")
            data = models.get("data") if isinstance(models, dict) else None
            ready_line = READY_LINES[engine.setting.engine]
            if data and ready_line in engine.log_path.read_text(errors="replace"):
                engine.model = str(data[0]["id"])
                return
        except (OSError, ValueError, urllib.error.URLError):
            pass
        time.sleep(1.0)
    tail = engine.log_path.read_text(errors="replace")[-3000:]
    raise RuntimeError(f"{engine.setting.engine} not ready after {timeout_s:.0f} s:\n{tail}")


def stop_process_group(proc: subprocess.Popen[bytes], grace_s: float = 20.0) -> None:
    """SIGTERM the engine's whole group (its ranks are children), SIGKILL what is left."""
    if proc.poll() is None or _group_alive(proc.pid):
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and _group_alive(proc.pid):
            proc.poll()
            time.sleep(0.2)
        if _group_alive(proc.pid):
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextmanager
def running_engine(setting: EngineSetting, log_path: Path,
                   ready_timeout_s: float = READY_TIMEOUT_S) -> Iterator[RunningEngine]:
    """Start ``setting`` with its log (stdout and stderr) going to ``log_path``; stop it on exit."""
    port = free_port()
    argv, env = engine_command(setting, port)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                cwd=str(log_path.parent), start_new_session=True)
    engine = RunningEngine(setting, port, argv, log_path, proc)
    try:
        _wait_ready(engine, ready_timeout_s)
        engine.ready_s = time.monotonic() - started
        yield engine
    finally:
        stop_process_group(proc)


def group_cpu_seconds(pgid: int) -> dict[str, float]:
    """User plus system CPU seconds so far of each live process in the engine's process group (its
    ranks are children started in its session), keyed "PID NAME" by /proc/PID/comm: vLLM names its
    processes (VLLM::EngineCore, VLLM::Worker_PP0, ...), so a reader can tell the engine core and
    its ranks from the API server. A process that exits between the listing and the read is left out."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with suppress(OSError, ValueError, IndexError):
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
            if int(fields[2]) != pgid:  # field 5, the process group
                continue
            name = (entry / "comm").read_text().strip()
            out[f"{entry.name} {name}"] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


# Issue 47's long prompts: 950-1,900 tokens of the tier's model, more of them than a run sends, so
# no prompt repeats and the radix cache shares nothing beyond the chat template
LONG_PROMPT_TOKENS = (950, 1900)
LONG_PROMPTS = 400
# SGLang for them: a context that holds them, a pool that does not bind at C=8, the small chunk
LONG_PROMPT_FLAGS = ("--context-length", "2048", "--max-running-requests", "16")


def long_prompts_file(path: Path, seed: int = 0) -> Path:
    """A prompts JSONL (`gputrace load --prompts`) of LONG_PROMPTS prompts of 950-1,900 tokens:
    words that are one token each in the model's vocabulary (its space-led lower-case words),
    drawn at random. Written once; an existing file is kept."""
    if path.exists():
        return path
    vocab = json.loads((MODEL_DIR / "tokenizer.json").read_text())["model"]["vocab"]
    words = sorted(w[1:] for w in vocab if w.startswith("Ġ") and w[1:].isalpha() and w[1:].islower())
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for _ in range(LONG_PROMPTS):
            n = rng.randint(*LONG_PROMPT_TOKENS)
            f.write(json.dumps({"prompt": " ".join(rng.choice(words) for _ in range(n))}) + "\n")
    return path


def capture_level(engine: RunningEngine, run_dir: Path, *, concurrency: int, level_s: float,
                  max_tokens: int, prompts: Path | None = None, warmup_s: float = 0.0,
                  report: bool = False) -> subprocess.CompletedProcess[str]:
    """`gputrace run` over one closed-loop level, as a user captures a running engine: its log
    file and its /metrics (the stage timers), the built-in load; the report where ``report``. The
    requests in flight when the level ends run to their end (no --drain): an abandoned request's
    tokens are unknown, so the phase's client tok/s would miss what it emitted in the level.
    ``warmup_s`` runs the level's load before its phase begins (a closed loop of long prompts
    starts as a burst: its first outputs come tens of seconds in)."""
    import sys

    cfg = run_dir.parent / f"{run_dir.name}.toml"
    cfg.write_text(
        f'[run]\nname = "{engine.setting.engine}-{engine.setting.name}"\n\n'
        '[[hosts]]\nname = "engine-host"\n\n'
        f'[hosts.log]\nkind = "file"\npath = {json.dumps(str(engine.log_path))}\n'
        f'engine = "{engine.setting.engine}"\n\n'
        f'[hosts.engine_metrics]\nurl = "{engine.url}/metrics"\n\n[topology]\npp_size = {PP_SIZE}\n')
    argv = [sys.executable, "-m", "gputrace", "run", "--config", str(cfg), "--out", str(run_dir),
            "--listen", "", "--url", engine.url, "--model", engine.model,
            "--concurrency", str(concurrency), "--duration-per-level", str(level_s),
            "--max-tokens", str(max_tokens), "--ignore-eos", "--warmup", str(warmup_s),
            "--report" if report else "--no-report"]
    if prompts is not None:
        argv += ["--prompts", str(prompts)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=str(REPO))


# The series kept from each /metrics scrape (the gauges that say what the scheduler holds).
WATCHED_METRICS = (
    "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:gen_throughput", "sglang:token_usage",
    "sglang:num_used_tokens", "sglang:realtime_tokens_total", "sglang:prompt_tokens_total",
    "sglang:generation_tokens_total", "sglang:num_requests_total",
    # the scheduler loop's own timers per pp_rank (SGLang 0.5.23+): wall time by category
    "sglang:scheduler_stage_seconds_total", "sglang:scheduler_idle_seconds_total",
    "sglang:forward_execution_seconds_total", "sglang:fwd_occupancy",
    # the scheduler processes' CPU time per pp_rank: a run's share of cores other work left it
    "sglang:scheduler_process_cpu_seconds_total",
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    # vLLM's per-request timers, summed: what its requests waited for admission and spent in all
    "vllm:request_queue_time_seconds_sum", "vllm:request_queue_time_seconds_count",
    "vllm:e2e_request_latency_seconds_sum",
    # its steps' tokens (prompt chunks and decode share max_num_batched_tokens) and its prompts
    "vllm:iteration_tokens_total_sum", "vllm:iteration_tokens_total_count",
    "vllm:request_prompt_tokens_sum", "vllm:request_prompt_tokens_count",
)


def watched_samples(text: str) -> list[dict[str, object]]:
    """The watched series of one /metrics text: name, labels and value per sample."""
    from prometheus_client.parser import text_string_to_metric_families

    out: list[dict[str, object]] = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in WATCHED_METRICS:
                out.append({"name": sample.name, "labels": dict(sample.labels), "value": sample.value})
    return out


class MetricsScraper:
    """Scrapes an engine's /metrics about once a second in a thread, as the test's own view of
    what the engine held: one {"ts_ns", "samples"} per scrape."""

    def __init__(self, engine: RunningEngine, period_s: float = 1.0):
        import threading

        self.engine, self.period_s = engine, period_s
        self.snapshots: list[dict[str, object]] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="metrics-scraper", daemon=True)

    def _scrape(self) -> None:
        try:
            text = self.engine.metrics_text()
            self.snapshots.append({"ts_ns": time.time_ns(), "samples": watched_samples(text)})
        except (OSError, ValueError):
            self.errors += 1

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._scrape()
            self._stop.wait(self.period_s)

    def __enter__(self) -> MetricsScraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        # one scrape after what the block ran (a load that just ended): the counters then hold
        # every request it finished, whenever the last periodic scrape fell
        time.sleep(self.period_s)
        self._scrape()

    def series(self, name: str, **labels: str) -> list[tuple[int, float]]:
        """(ts_ns, value) of one series over the scrapes (summed over samples matching labels)."""
        out = []
        for snap in self.snapshots:
            values = [float(s["value"]) for s in snap["samples"]  # type: ignore[attr-defined]
                      if s["name"] == name and all(s["labels"].get(k) == v for k, v in labels.items())]
            if values:
                out.append((int(snap["ts_ns"]), sum(values)))  # type: ignore[call-overload]
        return out
