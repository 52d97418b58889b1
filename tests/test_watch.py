"""`gputrace watch` in a real terminal (a detached tmux pane) against a live collector that follows a
simulated SGLang PP8 engine and its agent while load runs: a row per stage, values that move, `q`."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import require_binary
from live_chain import (
    HOST,
    PP_SIZE,
    free_port,
    get_json,
    gputrace_argv,
    http_ok,
    process,
    sim_chain,
    wait_until,
)
from tmux_screen import Tmux, engine_line, stage_rows

pytestmark = [pytest.mark.system, pytest.mark.slow]

LEVELS = (4, 16)  # microbatch-cap: K = 2, so 2 and then 8 micro-batches of 2 for the 8 stages


def engine_figures(screen: list[str]) -> tuple[int, int, int] | None:
    """(running, queued, micro-batches in flight) as the engine line shows them, of the pool of 64
    and the 8 stages."""
    line = engine_line(screen)
    if line is None or line[1] != 64 or line[4] != PP_SIZE:
        return None
    running, _, queued, mbs, _ = line
    return running, queued, mbs


def test_watch_rows_per_stage_update_and_q_quits(tmp_path: Path) -> None:
    """In a 200x50 tmux pane the view shows PP0..PP7 with values that change; per phase, the
    engine's running total and its micro-batches in flight as the load and K = 2 make them (C=4: 4
    in 2, C=16: 16 in 8); a collector that stops answering turns the header red within 5 s with the
    age of the data; `q` ends it with 0."""
    tmux_bin = require_binary("/usr/bin/tmux", "tmux")
    # every decode step logged, as the README asks of SGLang: the engine's figures come from them
    with sim_chain(tmp_path / "chain", sets=("decode_log_interval=1",)) as c:
        port = free_port()
        collector_url = f"http://127.0.0.1:{port}"
        with process(gputrace_argv("collect", "--config", str(c.config), "--out", str(tmp_path / "run"),
                                   "--listen", f"127.0.0.1:{port}"), tmp_path / "collect.out") as collector:
            wait_until(lambda: http_ok(f"{collector_url}/healthz"), what="collector", proc=collector)
            load_env = {**os.environ, "GPUTRACE_MARK_URL": f"{collector_url}/v1/mark"}
            with open(tmp_path / "load.out", "wb") as load_log:
                load = subprocess.Popen(gputrace_argv("load", "--url", c.engine_url, "--model", "default",
                                                      "--concurrency", ",".join(map(str, LEVELS)),
                                                      "--duration-per-level", "14", "--max-tokens", "64"),
                                        stdout=load_log, stderr=subprocess.STDOUT, env=load_env)
            try:
                def engine_and_gpus_live() -> bool:
                    stages = get_json(f"{collector_url}/v1/status")["stages"]
                    assert isinstance(stages, list)
                    return len(stages) == PP_SIZE and all(
                        s["running_req"] is not None and s["utilization_ratio"] is not None for s in stages)
                wait_until(engine_and_gpus_live, what="engine lines and GPU samples for every stage")
                screens = watch_in_tmux(Tmux(tmux_bin, tmp_path), collector_url, collector)
            finally:
                load.terminate()
                load.wait(timeout=15)
    captures, by_phase, stale, exit_status, text_after_q = screens
    for screen in captures:
        rows = stage_rows(screen)
        assert sorted(rows) == list(range(PP_SIZE)), "\n".join(screen)
        assert all(f"{HOST}:{pp}" in rows[pp] for pp in rows), "\n".join(screen)
    changed = {pp for pp in range(PP_SIZE)
               if len({stage_rows(screen)[pp] for screen in captures}) > 1}
    assert changed, "no stage row changed between captures:\n" + "\n".join(captures[-1])
    # the engine's figures per phase, read off the screen: the median of a few redraws (a request
    # that ends leaves a micro-batch short until the load sends the next)
    for level in LEVELS:
        figures = [f for f in by_phase[level] if f is not None]
        assert len(figures) >= 3, (level, by_phase[level])
        running = sorted(f[0] for f in figures)[len(figures) // 2]
        in_flight = sorted(f[2] for f in figures)[len(figures) // 2]
        # the load's requests also spend time on the wire and waiting for their slot's next
        # prefill: the engine holds about 7/8 of a level of 16 at a time (its busy share says so)
        assert 0.75 * level <= running <= level, (level, figures)
        # no micro-batch above K = 2, and all at K but for one request being replaced (it joins a
        # micro-batch of its own until the next prefill: 4 running in 3 seen, CI stop 31 rerun)
        assert 2 * in_flight - 2 <= running <= 2 * in_flight, (level, figures)
    header, seconds, colored = stale
    assert "STALE: data" in header and seconds <= 5.0, (header, seconds)
    assert colored, f"the stale header is not drawn in red: {header!r}"
    assert exit_status == "0", text_after_q


def watch_in_tmux(tmux: Tmux, collector_url: str, collector: subprocess.Popen[bytes]) -> tuple[
        list[list[str]], dict[int, list[tuple[int, int, int] | None]], tuple[str, float, bool], str, str]:
    """Run the view in a detached 200x50 session: four captures a second apart; the engine's
    figures in each phase; the header after the collector is stopped (SIGSTOP: it hangs) and how
    long it took to turn stale; then `q`."""
    # A shell in the pane records watch's exit status: tmux itself sometimes leaves the exited
    # process unreaped (pane_dead 1, pane_dead_status empty) for many seconds.
    status_file = tmux.socket.with_name("watch.status")
    watch_cmd = shlex.join(gputrace_argv("watch", "--collector", collector_url, "--refresh", "0.3"))
    tmux("new-session", "-d", "-s", "watch", "-x", "200", "-y", "50",
         f"{watch_cmd}; echo $? > {shlex.quote(str(status_file))}")
    try:
        wait_until(lambda: len(stage_rows(tmux.capture())) == PP_SIZE, timeout_s=20, what="watch draws")
        captures = []
        for _ in range(4):
            captures.append(tmux.capture())
            time.sleep(1.0)
        by_phase: dict[int, list[tuple[int, int, int] | None]] = {}
        for level in LEVELS:
            wait_until(lambda level=level: f"phase C={level} " in "\n".join(tmux.capture()), timeout_s=30,
                       what=f"phase C={level} on screen")
            time.sleep(5.0)  # the level settles: its requests admitted, the first ones replaced
            by_phase[level] = []
            for _ in range(5):
                by_phase[level].append(engine_figures(tmux.capture()))
                time.sleep(0.7)
        collector.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            wait_until(lambda: "STALE" in tmux.capture()[0], timeout_s=10, what="a stale header")
            seconds = time.monotonic() - stopped
            header = tmux.capture()[0]
            colored_header = tmux("capture-pane", "-p", "-e", "-t", "watch").splitlines()[0]
        finally:
            collector.send_signal(signal.SIGCONT)
        red = "41m" in colored_header or "[41" in colored_header or ";41" in colored_header
        tmux("send-keys", "-t", "watch", "q")
        try:
            wait_until(lambda: status_file.exists() and status_file.read_text().strip() != "", timeout_s=10,
                       what="watch exits on q")
        except AssertionError as exc:
            raise AssertionError(f"{exc}:\n" + "\n".join(tmux.capture())) from None
        return (captures, by_phase, (header, seconds, red), status_file.read_text().strip(),
                "\n".join(tmux.capture()))
    finally:
        tmux.kill()
