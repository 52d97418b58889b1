"""The collector's live state: the per-stage bubble estimate sets each utilization sample against
whether the stage had work at that time, on the collector's clock."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gputrace.live import LiveCollector, LiveState
from gputrace.model import ClockProbe, EngineConfig, EngineMetricSample, GpuSample, SchedulerEvent
from gputrace.topology import Placement

S = 1_000_000_000
T0 = 1_800_000_000 * S  # collector clock at the start of the window


def event(pp: int, running: int, queued: int, recv_s: float) -> SchedulerEvent:
    return SchedulerEvent(host="node0", source="file:log", engine="sglang", kind="decode", line_no=1,
                          pp_rank=pp, running_req=running, queue_req=queued,
                          recv_ts_ns=T0 + int(recv_s * S))


def samples(gpu: int, utilization: list[float], host_ahead_s: float = 0.0) -> list[GpuSample]:
    """One sample a second from T0, stamped on a host clock ``host_ahead_s`` ahead of the collector."""
    return [GpuSample(host="node0", gpu_index=gpu, ts_ns=T0 + int((i + host_ahead_s) * S),
                      utilization_ratio=u) for i, u in enumerate(utilization)]


def state(now_s: float = 10.0) -> LiveState:
    return LiveState("run", [Placement("node0", 0, 0), Placement("node0", 1, 1)], window_s=20.0,
                     clock_ns=lambda: T0 + int(now_s * S))


def test_idle_before_the_load_is_not_a_bubble() -> None:
    """Stage 0 idles with no work for 5 s, then runs half busy with work: bubble 0.25 over the
    window (the old estimate, 1 - mean utilization while work is there now, said 0.75)."""
    live = state()
    live.on_event(event(0, 0, 0, 0.0))
    live.on_event(event(0, 8, 24, 4.5))
    live.on_event(event(1, 8, 0, 0.0))
    live.on_samples(samples(0, [0.0] * 5 + [0.5] * 5))
    live.on_samples(samples(1, [1.0] * 10))
    rows = {r.pp_rank: r for r in live.stages()}
    assert rows[0].bubble_ratio == 0.25
    assert rows[1].bubble_ratio == 0.0
    assert rows[0].running_req == 8 and rows[0].queue_req == 24


def test_work_ending_ends_the_bubble() -> None:
    """Work that ends at 3 s leaves the idle seconds after it out of the bubble."""
    live = state()
    live.on_event(event(0, 4, 0, 0.0))
    live.on_event(event(0, 0, 0, 2.5))
    live.on_samples(samples(0, [0.5] * 10))
    (row, *_) = live.stages()
    assert row.bubble_ratio == 0.5 * 3 / 10


def test_sample_times_are_corrected_by_the_hosts_clock_probe() -> None:
    """A host clock 2 s ahead: without its probe the samples fall 2 s late against the engine's
    changes; with it they line up again."""
    def estimate(probe: bool) -> float:
        live = state(now_s=12.0)
        live.on_event(event(0, 0, 0, 0.0))
        live.on_event(event(0, 8, 0, 4.5))
        if probe:  # the agent answered at the midpoint of a 2 ms round trip, 2 s ahead
            live.on_clock_probe(ClockProbe("node0", T0, T0 + 1_000_000 + 2 * S, T0 + 2_000_000, via="agent"))
        live.on_samples(samples(0, [0.0] * 5 + [0.5] * 5, host_ahead_s=2.0), clock_host="node0")
        (row, *_) = live.stages()
        value = row.bubble_ratio
        assert value is not None
        return float(value)
    assert estimate(probe=True) == 0.25
    assert estimate(probe=False) == (2 * 1.0 + 5 * 0.5) / 10  # two idle seconds counted as bubble


def test_no_samples_no_estimate_and_the_gauge_carries_it() -> None:
    """A stage without utilization samples has no estimate (no series); one with them is exported."""
    live = state()
    live.on_event(event(0, 8, 0, 0.0))
    live.on_event(event(1, 8, 0, 0.0))
    live.on_samples(samples(0, [0.25] * 10))
    registry = CollectorRegistry()
    registry.register(LiveCollector(live))
    text = generate_latest(registry).decode()
    assert 'gputrace_stage_bubble_ratio{pp_rank="0",run="run"} 0.75' in text
    assert 'gputrace_stage_bubble_ratio{pp_rank="1"' not in text


def test_the_live_finding_is_exported_as_the_line_watch_shows() -> None:
    """gputrace_live_finding_info carries the status' finding line and its cause (the dashboard's
    'Finding now' panel); one series, value 1."""
    live = state()
    live.on_event(event(0, 8, 24, 4.5))
    live.on_event(event(1, 8, 0, 4.5))
    live.on_samples(samples(0, [0.1] * 10))
    registry = CollectorRegistry()
    registry.register(LiveCollector(live))
    finding = live.status().finding
    assert finding and finding.split(":")[0] in ("bubble", "pipeline_underfilled", "admission_bound")
    lines = [ln for ln in generate_latest(registry).decode().splitlines()
             if ln.startswith("gputrace_live_finding_info{")]
    cause = finding.split(":")[0]
    assert lines == [f'gputrace_live_finding_info{{cause="{cause}",finding="{finding}",run="run"}} 1.0']


def test_the_live_finding_names_the_cap_when_every_slot_is_full_below_the_pool() -> None:
    """A sweep at C=64 on PP8 at K=2: 16 run in 8 full micro-batches, 48 wait, the pool (64) is not
    reached: microbatch_cap, in the report's own words (the live view read 'no finding now: 8
    micro-batches fill the 8 stages'); at the pool it is admission_bound; few micro-batches while
    the stages idle, underfilled; a full pipeline, no finding."""
    from gputrace.live import EngineNow, LiveStage, current_finding
    from gputrace.run_tables import EngineSettings

    settings = EngineSettings(engine="sglang", pp_size=8, max_running_requests=64, pp_max_micro_batch_size=2)

    def finding(running: float, queued: float, mbs: float, bubble: float | None = None) -> str:
        engine = EngineNow(running, queued, mbs, slots=8, k=2, pool=64, source="period", engine_kind="sglang")
        size = running / mbs
        lines = {pp: [(T0, size, queued, 0.3)] * 4 for pp in range(8)}
        stages = [LiveStage(pp, busy_ratio=None if bubble is None else 1 - bubble, bubble_ratio=bubble)
                  for pp in range(8)]
        return current_finding(engine, stages, 8, settings, lines)

    assert finding(16, 48, 8) == (
        "microbatch_cap: every micro-batch holds K = 2 (--pp-max-micro-batch-size): the engine runs about "
        "16 of its 64 pool rows while 64 requests are offered and 48 wait in the queue")
    assert finding(64, 10, 8).startswith("admission_bound: the engine runs 64 requests, its limit "
                                         "(max_running_requests = 64), while 74 are offered and 10 wait")
    assert finding(6, 0, 3, bubble=0.6).startswith("pipeline_underfilled: 3.0 micro-batches in flight for 8")
    assert finding(16, 0, 8, bubble=0.05) == "no finding now: 8 micro-batches fill the 8 stages"


def _vllm_stats(running: int, waiting: int, gen_tok_s: float, recv_s: float) -> SchedulerEvent:
    return SchedulerEvent(host="node0", source="file:log", engine="vllm", kind="stats", line_no=1, pp_rank=0,
                          running_req=running, queue_req=waiting, gen_throughput_tok_s=gen_tok_s,
                          recv_ts_ns=T0 + int(recv_s * S))


def test_a_vllm_stats_line_read_at_batch_turnover_is_not_an_idle_engine() -> None:
    """The real vLLM PP2 logged "Running: 0 reqs, Waiting: 0 reqs" with 96 tok/s generated over
    the interval while one request was in flight (engine tier, C=1): the live view kept its last
    reading (it said "idle: the engine runs no request"). With the load's own count: 0 and 0 while
    requests are in flight keeps the reading, with none in flight it is idle; without that count,
    the tokens generated decide."""
    live = state()
    live.on_event(_vllm_stats(1, 0, 40.0, 1.0))
    live.on_event(_vllm_stats(0, 0, 96.0, 2.0))
    assert live.engine_now().running == 1
    assert not (live.status().finding or "").startswith("idle")
    live.on_event(_vllm_stats(0, 0, 0.0, 3.0))  # nothing generated: the engine is idle
    assert live.engine_now().running == 0
    in_flight = [4]
    live.inflight_probe = lambda: in_flight[0]
    live.on_event(_vllm_stats(4, 0, 250.0, 4.0))
    live.on_event(_vllm_stats(0, 0, 280.0, 5.0))
    assert live.engine_now().running == 4
    in_flight[0] = 0  # the load has ended: the same line is the drained engine
    live.on_event(_vllm_stats(0, 0, 280.0, 6.0))
    assert live.engine_now().running == 0


def _vllm_scrape(running: float, waiting: float, tokens: float, at_s: float) -> list[EngineMetricSample]:
    labels = json.dumps({"engine": "0", "model_name": "m"})
    gauges = (("vllm:num_requests_running", running), ("vllm:num_requests_waiting", waiting),
              ("vllm:generation_tokens_total", tokens))
    return [EngineMetricSample("node0", "http://engine/metrics", T0 + int(at_s * S), name, labels, value)
            for name, value in gauges]


def test_vllm_running_and_waiting_come_from_its_metrics_between_stats_lines() -> None:
    """A CI run of the real vLLM PP2 logged only turnover lines (0 and 0) over its whole sweep, so
    the live view had no running or queued count and the dashboard's panels were empty. Its /metrics
    gauges, scraped every second, fill the same rank (the stats line's, "Engine 000") under the same
    turnover rule: 0 and 0 while the generated-tokens counter grows keeps the last reading; with no
    growth it is the idle engine, whose 0 a later turnover forgets (requests are in flight again);
    the load's own count, where this process runs it, decides first."""
    live = state()
    live.on_event(_vllm_stats(0, 0, 96.0, 0.5))  # a turnover line: no reading yet
    assert live.engine_now().running is None
    live.on_engine_metrics(_vllm_scrape(8, 8, 100.0, 1.0))
    assert (live.engine_now().running, live.engine_now().queued) == (8, 8)
    assert list(live.engine) == [("node0", 0, 0, 0)]  # the line's rank, not a second one
    live.on_engine_metrics(_vllm_scrape(0, 0, 180.0, 2.0))  # turnover: tokens still grow
    assert (live.engine_now().running, live.engine_now().queued) == (8, 8)
    live.on_engine_metrics(_vllm_scrape(0, 0, 180.0, 3.0))  # nothing generated since: idle
    assert (live.engine_now().running, live.engine_now().queued) == (0, 0)
    # the load starts: a turnover now says the idle reading no longer holds, and nothing else
    live.on_engine_metrics(_vllm_scrape(0, 0, 185.0, 3.5))
    assert (live.engine_now().running, live.engine_now().queued) == (None, None)
    live.inflight_probe = lambda: 4
    live.on_engine_metrics(_vllm_scrape(4, 0, 190.0, 4.0))
    live.on_engine_metrics(_vllm_scrape(0, 0, 190.0, 5.0))  # 4 in flight: a turnover after all
    assert live.engine_now().running == 4
    registry = CollectorRegistry()
    registry.register(LiveCollector(live))
    text = generate_latest(registry).decode()
    labels = '{dp_rank="0",host="node0",pp_rank="0",run="run",tp_rank="0"}'
    assert f"gputrace_engine_running_requests{labels} 4.0" in text
    assert f"gputrace_engine_queue_requests{labels} 0.0" in text


def test_sglang_engine_total_never_exceeds_the_load_in_flight() -> None:
    """PP2 at C=1: every line holds the same request, so the period is ambiguous, and a first stage
    read fully busy counts it once per stage (the real SGLang's dashboard showed 2 running and 2
    micro-batches while the load had 1 in flight). The load's own count bounds the running total,
    and the micro-batches in flight never exceed the requests running."""
    live = state()
    for i in range(8):
        live.on_event(SchedulerEvent(host="node0", source="file:log", engine="sglang", kind="decode",
                                     line_no=i, pp_rank=0, running_req=1, queue_req=0,
                                     recv_ts_ns=T0 + int(i * 0.1 * S)))
    unbounded = live.engine_now(first_stage_busy=1.0)
    assert unbounded.running == 2 and unbounded.microbatches_in_flight == 2
    live.inflight_probe = lambda: 1
    bounded = live.engine_now(first_stage_busy=1.0)
    assert bounded.running == 1 and bounded.microbatches_in_flight == 1


def test_the_live_admission_finding_names_the_engines_own_flag() -> None:
    """vLLM's pool is --max-num-seqs: its live finding named SGLang's --max-running-requests (seen
    in the 'Finding now' panel of the real vLLM capture)."""
    live = state()
    live.on_config(EngineConfig("node0", "file:log", "vllm", 1, max_running_requests=8))
    live.on_event(_vllm_stats(8, 8, 500.0, 1.0))
    assert live.status().finding == ("admission_bound: the engine runs 8 requests, its limit "
                                     "(max_num_seqs = 8), while 16 are offered and 8 wait")
    sglang = state()
    sglang.on_config(EngineConfig("node0", "file:log", "sglang", 1, max_running_requests=8))
    sglang.on_event(event(0, 8, 8, 1.0))
    assert "its limit (max_running_requests = 8)" in (sglang.status().finding or "")


def test_a_stage_without_lines_of_its_own_has_the_engines_work() -> None:
    """vLLM logs one stats line for the engine (pp_rank 0): stage 1, half busy while 8 run, idles
    half the time as stage 0 does (it read bubble 0 beside busy 90 %: no work known for it, on the
    real engine's `watch`)."""
    live = state()
    live.on_event(_vllm_stats(8, 8, 500.0, 0.0))
    live.on_samples(samples(0, [0.5] * 10))
    live.on_samples(samples(1, [0.5] * 10))
    rows = {r.pp_rank: r for r in live.stages()}
    assert rows[0].bubble_ratio == rows[1].bubble_ratio == 0.5


def _timer(name: str, pp: int, category: str, per_s: float) -> list[EngineMetricSample]:
    """An SGLang timer counter of rank pp (``sglang:scheduler_stage_seconds_total`` by category, or
    the device timer), scraped once a second from T0 to T0 + 10 s, rising ``per_s`` seconds a second."""
    labels = json.dumps({"category": category, "pp_rank": str(pp), "tp_rank": "0"}, sort_keys=True)
    return [EngineMetricSample("node0", "http://engine/metrics", T0 + i * S, name, labels, per_s * i)
            for i in range(11)]


def _stage_seconds(pp: int, category: str, per_s: float) -> list[EngineMetricSample]:
    return _timer("sglang:scheduler_stage_seconds_total", pp, category, per_s)


def _device_seconds(pp: int, per_s: float) -> list[EngineMetricSample]:
    return _timer("sglang:forward_execution_seconds_total", pp, "forward", per_s)


def test_without_sm_activity_the_engines_loop_timers_give_the_busy_share() -> None:
    """[busy] in the live view: utilization.gpu reads 100 % while the stages wait in NCCL; SGLang's
    loop timers say each stage ran its forward 40 % of the time. The live busy share is the timers'
    and the bubble the rest of the time with work, as the report ranks the signals; with SM activity
    present the GPUs' figure stays, and the device timer ranks above both."""
    live = state()
    live.on_event(event(0, 8, 0, -10.0))
    live.on_event(event(1, 8, 0, -10.0))
    live.on_samples(samples(0, [1.0] * 10))
    live.on_samples(samples(1, [1.0] * 10))
    for pp in (0, 1):
        live.on_engine_metrics(_stage_seconds(pp, "run_batch", 0.4) + _stage_seconds(pp, "other", 0.6))
    rows = {r.pp_rank: r for r in live.stages()}
    for pp in (0, 1):
        assert rows[pp].busy_signal == "the engine's loop timers (run_batch)"
        assert rows[pp].busy_ratio == pytest.approx(0.4)
        assert rows[pp].bubble_ratio == pytest.approx(0.6)
        assert rows[pp].utilization_ratio == 1.0  # still shown beside it
    registry = CollectorRegistry()
    registry.register(LiveCollector(live))
    text = generate_latest(registry).decode()
    assert 'gputrace_stage_bubble_ratio{pp_rank="0",run="run"} 0.6' in text
    assert "the engine's loop timers (run_batch)" in text

    with_sm = state()
    with_sm.on_event(event(0, 8, 0, -10.0))
    with_sm.on_samples([GpuSample(host="node0", gpu_index=0, ts_ns=T0 + i * S, utilization_ratio=1.0,
                                  sm_active_ratio=0.5) for i in range(10)])
    with_sm.on_engine_metrics(_stage_seconds(0, "run_batch", 0.4))
    (row, *_) = with_sm.stages()
    assert row.busy_signal == "SM activity (GPM)" and row.busy_ratio == 0.5
    with_sm.on_engine_metrics(_device_seconds(0, 0.3))
    (row, *_) = with_sm.stages()
    assert row.busy_signal == "the engine's device timer (forward_execution_seconds)"
    assert row.busy_ratio == pytest.approx(0.3) and row.bubble_ratio == pytest.approx(0.7)


def test_timers_without_work_give_no_bubble() -> None:
    """The engine's timers over a window with no requests: busy as timed, no bubble (idle without
    work is not a bubble)."""
    live = state()
    live.on_event(event(0, 0, 0, -10.0))
    live.on_engine_metrics(_stage_seconds(0, "run_batch", 0.0) + _stage_seconds(0, "idle", 1.0))
    (row, *_) = live.stages()
    assert row.busy_signal == "the engine's loop timers (run_batch)"
    assert row.busy_ratio == 0.0 and row.bubble_ratio == 0.0
