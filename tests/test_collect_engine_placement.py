"""[engines] How a capture's stages were placed on GPUs is the engine's rule, named in its words:
`gputrace collect` on a vLLM log writes vLLM's rule into meta.json's topology and the report's
stage mapping says it (it said "sglang-formula" for every engine)."""

from __future__ import annotations

import datetime as dt
import json
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from helpers import free_port
from live_chain import http_ok, wait_until

from gputrace.config import parse_config
from gputrace.store import Store


def vllm_line(at: dt.datetime) -> str:
    return (f"(APIServer pid=8661) INFO {at:%m-%d %H:%M:%S} [loggers.py:335] Engine 000: Avg prompt "
            "throughput: 41.1 tokens/s, Avg generation throughput: 78.0 tokens/s, Running: 4 reqs, "
            "Waiting: 0 reqs, GPU KV cache usage: 1.0%, Prefix cache hit rate: 0.0%\n")


def http_answer(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        answer: dict[str, Any] = json.loads(resp.read())
        return answer


def _config(tmp_path: Path, engine: str, extra: str = "") -> Path:
    log = tmp_path / f"{engine}.log"
    log.touch()
    cfg = tmp_path / "gputrace.toml"
    cfg.write_text(f'[[hosts]]\nname = "node0"\n\n[hosts.log]\nkind = "file"\npath = {json.dumps(str(log))}\n'
                   f'engine = "{engine}"\n\n[topology]\npp_size = 2\n{extra}')
    return cfg


@pytest.mark.parametrize(("engine", "extra", "source"), [
    ("vllm", "", "vllm-rank-order"),
    ("sglang", "", "sglang-formula"),
    ("vllm", '\n[[topology.map]]\nhost = "node0"\ngpu = 0\npp_rank = 0\n\n'
             '[[topology.map]]\nhost = "node0"\ngpu = 1\npp_rank = 1\n', "explicit"),
])
def test_the_config_names_its_engines_placement_rule(tmp_path: Path, engine: str, extra: str,
                                                     source: str) -> None:
    """The configured engine's rule, or "explicit" where the config maps the GPUs itself."""
    cfg = parse_config(_config(tmp_path, engine, extra).read_text(), tmp_path / "gputrace.toml")
    assert cfg.placement_source == source
    assert [(p.gpu_index, p.pp_rank) for p in cfg.placements()] == [(0, 0), (1, 1)]


def test_a_vllm_capture_names_vllms_placement_rule_in_meta_and_report(tmp_path: Path) -> None:
    """`gputrace collect` following a vLLM log: meta.json's topology.source is vLLM's rule, and the
    report's stage mapping line names it, with no word of SGLang's."""
    cfg = _config(tmp_path, "vllm")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gputrace", "collect", "--config", str(cfg), "--out",
                             str(tmp_path / "run"), "--listen", f"127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: http_ok(f"http://127.0.0.1:{port}/healthz"), timeout_s=30)
        now = dt.datetime.now(dt.UTC)
        with (tmp_path / "vllm.log").open("a") as log:  # a minute of 10 s stats windows
            log.writelines(vllm_line(now + dt.timedelta(seconds=s)) for s in range(-60, 1, 10))
        status = f"http://127.0.0.1:{port}/v1/status"
        wait_until(lambda: http_answer(status)["counts"]["scheduler_events"] == 7, timeout_s=30)
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()[-2000:]
    with Store.open(tmp_path / "run", read_only=True) as store:
        assert store.meta.topology["source"] == "vllm-rank-order"
    out = subprocess.run([sys.executable, "-m", "gputrace", "report", str(tmp_path / "run"), "--format", "md",
                          "--out", str(tmp_path / "report")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = (tmp_path / "report" / "report.md").read_text()
    (line,) = [x for x in text.splitlines() if "stage mapping:" in x]
    assert "vllm-rank-order" in line and "sglang" not in line.lower(), line
