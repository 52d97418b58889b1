"""The load generator against the real component it drives in the demo: the simulator's real-time
OpenAI-compatible server (gputrace.sim.server), run here at 2x speed: at 20x a level of C=24
lasted ~0.5 s, and one stall of the shared machine halved its throughput (CI, stop 31: C=24 read
below C=8; at 5x, C=24 read 1036 tok/s against C=8's 1200 on a busy CI machine: 24 streams of
SSE at 5x outran two shared cores)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gputrace.load import LoadSpec, run_load
from gputrace.load.stats import inflight_series

server_mod = pytest.importorskip("gputrace.sim.server")
params_mod = pytest.importorskip("gputrace.sim.params")


@pytest.fixture
async def sim(tmp_path: Path) -> AsyncIterator[object]:
    """A simulated SGLang PP8 deployment behind its HTTP server, on a free port."""
    server = await server_mod.start_sim_server(
        params_mod.SimParams(), log_path=tmp_path / "sglang.log", speed=2.0
    )
    yield server
    await server.close()


async def test_sweep_against_simulator(sim: object, tmp_path: Path) -> None:
    """Every level holds exactly C requests in the simulator; records and markers are complete."""
    url = sim.url  # type: ignore[attr-defined]
    spec = LoadSpec(url=url, model="default", concurrency=(1, 8, 24), max_tokens=24, requests_per_level=48)
    result = await run_load(spec)
    assert [(m.label, m.target_concurrency) for m in result.markers] == [
        ("C=1", 1), ("C=8", 8), ("C=24", 24), ("end", None)]
    assert len(result.requests) == 3 * 48
    assert all(r.ok for r in result.requests), [r.error for r in result.requests if not r.ok][:3]
    for r in result.requests:
        assert r.first_token_ns is not None and r.end_ns is not None
        assert r.start_ns < r.first_token_ns <= r.end_ns
        assert r.completion_tokens == 24 and r.prompt_tokens is not None and r.prompt_tokens > 0
    times, counts = inflight_series(result.requests)
    for lv in result.levels:
        c = lv.target_concurrency
        assert c is not None and lv.steady_start_ns is not None
        steady = (times >= lv.steady_start_ns) & (times < lv.end_ns)
        assert counts[steady].max() == c
        assert lv.inflight_mean == pytest.approx(c, rel=0.01) and not lv.short
    # The simulated engine's throughput grows with C, and it logged its decode batches.
    tok_s = [lv.aggregate_tok_s or 0.0 for lv in result.levels]
    assert tok_s[0] < tok_s[1] < tok_s[2]
    assert "Decode batch" in (tmp_path / "sglang.log").read_text()
