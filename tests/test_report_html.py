"""The HTML report and comparison in headless Chromium (DevTools protocol over a websocket, a
1,300 px window): no console error, every figure rendered, nothing wider than the window; of a
simulated run and of a recorded real-engine capture; screenshots are kept in tests/artifacts/."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import require_binary
from engine_fixtures import fixture_dir
from helpers import gputrace_process

from gputrace.analyse import analyse_run
from gputrace.analysis.compare import compare_analyses
from gputrace.report.compare_render import write_compare
from gputrace.report.figures import FIGURES
from gputrace.report.render import write_report
from gputrace.sim.outputs import write_store
from gputrace.sim.virtual import run_scenario
from gputrace.store import Store

ARTIFACTS = Path(__file__).parent / "artifacts"
VIEWPORT_PX = 1300
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-port=0"]


class Cdp:
    """A minimal DevTools-protocol client on one page target."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse):
        self.ws = ws
        self.next_id = 0
        self.events: list[dict[str, Any]] = []

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        my_id = self.next_id
        await self.ws.send_json({"id": my_id, "method": method, "params": params})
        while True:
            msg = json.loads((await self.ws.receive(timeout=30)).data)
            if msg.get("id") == my_id:
                if "error" in msg:
                    raise AssertionError(f"{method}: {msg['error']}")
                return dict(msg.get("result", {}))
            self.events.append(msg)

    async def wait_event(self, method: str, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(e.get("method") == method for e in self.events):
            msg = json.loads((await self.ws.receive(timeout=max(deadline - time.monotonic(), 0.1))).data)
            self.events.append(msg)


def _devtools_port(profile: Path, proc: subprocess.Popen[bytes], timeout_s: float = 30) -> int:
    deadline = time.monotonic() + timeout_s
    marker = profile / "DevToolsActivePort"
    while time.monotonic() < deadline:
        if marker.exists() and marker.read_text().strip():
            return int(marker.read_text().split()[0])
        if proc.poll() is not None:
            raise AssertionError(f"chromium exited with {proc.returncode}")
        time.sleep(0.05)
    raise AssertionError("chromium wrote no DevToolsActivePort")


async def _inspect(port: int, url: str, shot: Path) -> tuple[list[str], dict[str, Any]]:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{port}/json/list") as resp:
            pages = [t for t in await resp.json() if t["type"] == "page"]
        async with http.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            cdp = Cdp(ws)
            for domain in ("Page", "Runtime", "Log"):
                await cdp.call(f"{domain}.enable")
            # a desktop window (headless Chromium's 800 px shrank the 1,300 px figures to 740)
            await cdp.call("Emulation.setDeviceMetricsOverride", width=VIEWPORT_PX, height=900,
                           deviceScaleFactor=1, mobile=False)
            await cdp.call("Page.navigate", url=url)
            await cdp.wait_event("Page.loadEventFired")
            res = await cdp.call("Runtime.evaluate", returnByValue=True, expression=(
                "JSON.stringify({title: document.title, imgs: Array.from(document.images).map("
                "i => ({id: i.id, complete: i.complete, w: i.naturalWidth, h: i.naturalHeight})),"
                "h2: Array.from(document.querySelectorAll('h2')).map(h => h.textContent),"
                "scroll_w: document.documentElement.scrollWidth, view_w: window.innerWidth,"
                # what sticks out, named in a failure's message
                "wide: Array.from(document.querySelectorAll('body *')).filter(e =>"
                " e.getBoundingClientRect().right > window.innerWidth + 0.5).slice(-4).map(e =>"
                " e.tagName + '.' + e.className + ': ' + (e.textContent || '').slice(0, 120))})"))
            page = json.loads(res["result"]["value"])
            png = await cdp.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
            shot.write_bytes(base64.b64decode(png["data"]))
            errors = [json.dumps(e["params"])[:300] for e in cdp.events if
                      (e.get("method") == "Runtime.consoleAPICalled" and e["params"]["type"] == "error")
                      or e.get("method") == "Runtime.exceptionThrown"
                      or (e.get("method") == "Log.entryAdded" and e["params"]["entry"]["level"] == "error")]
            return errors, page


@contextlib.contextmanager
def _chromium(chromium: str) -> Iterator[int]:
    """A headless Chromium; yields its DevTools port."""
    # Chromium's helper processes can still write into the profile after the browser exits (CI
    # once failed on "Directory not empty" there): stop the whole group, and let cleanup be lenient
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        proc = subprocess.Popen([chromium, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            yield _devtools_port(Path(profile), proc)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.mark.system
async def test_report_renders_in_headless_chromium(tmp_path: Path) -> None:
    """report.html loads with no console error and every figure decoded (naturalWidth > 0)."""
    chromium = require_binary("/usr/bin/chromium", "chromium", "chromium-browser")
    run = write_store(run_scenario("microbatch-cap", 0), tmp_path / "run")
    with Store.open(run, read_only=True) as store:
        written = write_report(analyse_run(store, effects=False), tmp_path / "out", ["html"])
    html_file = written[0]
    assert html_file.name == "report.html" and "src='http" not in html_file.read_text()
    ARTIFACTS.mkdir(exist_ok=True)
    with _chromium(chromium) as port:
        errors, page = await asyncio.wait_for(
            _inspect(port, html_file.as_uri(), ARTIFACTS / "report_html.png"), 90)
    assert errors == []
    assert len(page["imgs"]) == len(FIGURES)
    assert all(i["complete"] and i["w"] > 0 and i["h"] > 0 for i in page["imgs"]), page["imgs"]
    # the first screen (the advice, the busy heatmap, measured vs predicted) comes before these;
    # then the per-phase table, the findings as evidence, the figures, the folded reference ([ux])
    assert page["h2"][:4] == ["Per phase", "Findings: the evidence", "Figures", "Details"]
    assert (ARTIFACTS / "report_html.png").stat().st_size > 10_000
    assert all(i["w"] >= 1200 for i in page["imgs"]), page["imgs"]  # legible at the page's width
    assert page["scroll_w"] <= page["view_w"], page  # no table wider than the window


@pytest.mark.system
async def test_compare_renders_in_headless_chromium(tmp_path: Path) -> None:
    """compare.html of the cap against its fix loads with no console error, in the order a reader
    wants it (what changed, the two runs, per phase); a screenshot is kept in tests/artifacts/."""
    chromium = require_binary("/usr/bin/chromium", "chromium", "chromium-browser")
    analyses = {}
    for name in ("microbatch-cap", "microbatch-fixed"):
        with Store.open(write_store(run_scenario(name, 0), tmp_path / name), read_only=True) as store:
            analyses[name] = analyse_run(store, effects=False)
    doc = compare_analyses(analyses["microbatch-cap"], analyses["microbatch-fixed"])
    html_file = write_compare(doc, tmp_path / "cmp", ["html"])[0]
    ARTIFACTS.mkdir(exist_ok=True)
    with _chromium(chromium) as port:
        errors, page = await asyncio.wait_for(
            _inspect(port, html_file.as_uri(), ARTIFACTS / "compare_html.png"), 90)
    assert errors == []
    assert page["h2"] == ["What changed", "The two runs", "Per phase"]
    assert "Resolved in phase" in html_file.read_text()
    assert (ARTIFACTS / "compare_html.png").stat().st_size > 10_000
    assert page["scroll_w"] <= page["view_w"], page


def _gputrace(*args: str) -> None:
    done = gputrace_process(*args, timeout_s=180)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.system
async def test_a_real_engine_capture_renders_in_headless_chromium(tmp_path: Path) -> None:
    """The recorded SGLang PP2 runs (default and K 16, no GPU samples) imported, reported and
    compared as a user would: both pages load with no console error and no table wider than
    the window, the verdict names the engine flag, and no busy signal is claimed for stages
    that have no busy figure; screenshots are kept in tests/artifacts/."""
    chromium = require_binary("/usr/bin/chromium", "chromium", "chromium-browser")
    runs = {}
    for name in ("default", "k16"):
        where, runs[name] = fixture_dir("sglang", name), tmp_path / name
        date = json.loads((where / "args.json").read_text())["recorded_utc"][:10]
        _gputrace("import", "--run", str(runs[name]), "--host", "engine-host", "--sglang-log",
                  str(where / "engine.log"), "--requests", str(where / "requests.jsonl"), "--date", date,
                  "--no-progress")
        _gputrace("report", str(runs[name]), "--no-progress")
    _gputrace("compare", str(runs["default"]), str(runs["k16"]), "--out", str(tmp_path / "cmp"))
    report, compare = runs["default"] / "report" / "report.html", tmp_path / "cmp" / "compare.html"
    ARTIFACTS.mkdir(exist_ok=True)
    with _chromium(chromium) as port:
        errors, page = await asyncio.wait_for(
            _inspect(port, report.as_uri(), ARTIFACTS / "engine_report_html.png"), 90)
        cmp_errors, cmp_page = await asyncio.wait_for(
            _inspect(port, compare.as_uri(), ARTIFACTS / "engine_compare_html.png"), 90)
    assert errors == [] and cmp_errors == []
    assert len(page["imgs"]) == len(FIGURES) and all(i["complete"] and i["w"] >= 1200 for i in page["imgs"])
    assert page["scroll_w"] <= page["view_w"] and cmp_page["scroll_w"] <= cmp_page["view_w"], \
        (page["wide"], cmp_page["wide"])
    text = report.read_text()
    assert "class='answer'>Advice: " in text and "Next step" not in text  # [ux] one answer first
    assert "admission_bound (phase C=16, " in text
    assert "what its change would do: --max-running-requests" in text
    stage_table = text[text.index("<summary>Phase by stage</summary>"):
                       text.index("<summary>Stage mapping</summary>")]
    assert "<th>busy from</th>" not in stage_table and "NVML" not in stage_table
    assert "<th>host</th>" not in text  # no mapping: the note alone, not a table of headers
    assert cmp_page["h2"] == ["What changed", "The two runs", "Per phase", "Predicted against measured"]
    assert "New in phase C=16: pipeline_underfilled" in compare.read_text()
    # the first log leaves K to SGLang's default, the second states 16: the model predicts B
    assert "B changed pp_max_micro_batch_size default -&gt; 16" in compare.read_text()
