"""Diagnosis rules on runs built from records in memory as RunTables (no DuckDB file; a test that
needs other rows edits the tables): each cause found where it is built in, and a healthy run has no
finding."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
from analysis_synth import Level, SynthRun, requests_to_gauge, synth_tables

from gputrace.analysis.aligned_run import ENGINE_IN_FLIGHT
from gputrace.analysis.diagnose import CAUSES, Finding
from gputrace.analysis.phase_figures import PhaseMetrics
from gputrace.analysis.result import Analysis, analyse_tables
from gputrace.run_tables import EngineSettings, RequestColumns, RunTables
from gputrace.vocabulary import Change


def _analyse(path: Path, spec: SynthRun, edit: Callable[[RunTables], RunTables] | None = None) -> Analysis:
    """The run analysed from tables in memory (no DuckDB file), ``edit`` applied to them first."""
    tables = synth_tables(spec)[0]
    return analyse_tables(edit(tables) if edit is not None else tables)


def _causes(a: Analysis) -> set[str]:
    assert all(f.cause in CAUSES for f in a.findings)
    return {f.cause for f in a.findings}


def test_microbatch_cap_first_with_k(tmp_path: Path) -> None:
    """PP8, max_running_requests 64, --pp-max-micro-batch-size 2, 32 in flight: #running-req 2
    everywhere (8 slots of 2: 16 running) and 16 queued while the pool has 48 free rows: the cap,
    K = 2, raised to ceil(32 / 8 slots) = 4."""
    spec = SynthRun([Level("C=32", 32, 32, [0.9] * 8, 2, 10, queue=16)], pp=8,
                    engine={"max_running_requests": 64, "pp_max_micro_batch_size": 2})
    a = _analyse(tmp_path / "r", spec)
    first = a.findings[0]
    assert first.cause == "microbatch_cap" and first.evidence["K"] == 2
    assert first.evidence["K_from"] == "--pp-max-micro-batch-size"
    assert first.recommendation.startswith("--pp-max-micro-batch-size 4 ")
    assert first.change == Change("pp_max_micro_batch_size", "--pp-max-micro-batch-size", 4)
    assert _causes(a) == {"microbatch_cap"}


def test_one_micro_batch_at_k_with_free_slots_is_not_the_cap(tmp_path: Path) -> None:
    """#running-req 8 = K on every stage with 24 queued, but only 8 running of a pool of 64: a slot
    with room admits at its turn, so K cannot be what holds them (SGLang's K bounds each
    micro-batch, not the engine); no microbatch_cap finding."""
    spec = SynthRun([Level("C=32", 32, 32, [0.125] * 8, 8, 10, queue=24)], pp=8)
    assert "microbatch_cap" not in _causes(_analyse(tmp_path / "r", spec))


def test_no_cap_when_flag_raised(tmp_path: Path) -> None:
    """With --pp-max-micro-batch-size 64 and 8 micro-batches of 4 filling 8 stages: healthy."""
    spec = SynthRun([Level("C=32", 32, 32, [0.95] * 8, 4, 10)], pp=8,
                    engine={"max_running_requests": 64, "pp_max_micro_batch_size": 64})
    assert _causes(_analyse(tmp_path / "r", spec)) == set()


def test_pipeline_underfilled(tmp_path: Path) -> None:
    """Two micro-batches of 2 for 8 stages, below the cap: the pipeline is underfilled."""
    spec = SynthRun([Level("C=4", 4, 4, [0.25] * 8, 2, 10)], pp=8)
    a = _analyse(tmp_path / "r", spec)
    assert _causes(a) == {"pipeline_underfilled"}
    assert a.findings[0].evidence["allowed_busy_fraction"] == 0.25


def test_stage_imbalance_names_the_stage(tmp_path: Path) -> None:
    """One stage far busier than the median is named."""
    spec = SynthRun([Level("C=16", 16, 16, [0.6, 0.6, 0.95, 0.6], 4, 10)], pp=4)
    a = _analyse(tmp_path / "r", spec)
    assert _causes(a) == {"stage_imbalance"} and a.findings[0].stages == [2]


def test_client_bound(tmp_path: Path) -> None:
    """The client keeps 8 of the 32 requests asked for."""
    spec = SynthRun([Level("C=32", 32, 8, [0.9] * 4, 2, 10)], pp=4)
    a = _analyse(tmp_path / "r", spec)
    assert _causes(a) == {"client_bound"}
    assert a.findings[0].evidence["target_concurrency"] == 32


def test_no_client_bound_from_a_level_detected_in_the_gauge_itself(tmp_path: Path) -> None:
    """A phase whose level was detected from the in-flight gauge (no markers, no labels: a
    Prometheus with only the engine's gauges) has no asked-for level: the gauge's dips below its
    own detected level are not a client that falls short (seen at C=1 from vLLM's gauges)."""
    from gputrace.analysis.diagnose import diagnose

    spec = SynthRun([Level("C=32", 32, 8, [0.9] * 4, 2, 10)], pp=4)
    pm = _analyse(tmp_path / "r", spec).metrics[0]
    asked = dataclasses.replace(pm, target_concurrency=1, inflight_mean=0.6)
    detected = dataclasses.replace(asked, source=f"detected from {ENGINE_IN_FLIGHT}")
    engine = EngineSettings(engine="vllm", max_running_requests=8)
    assert "client_bound" in {f.cause for f in diagnose([asked], engine, 4)}
    assert "client_bound" not in {f.cause for f in diagnose([detected], engine, 4)}


def _without_requests(tables: RunTables) -> RunTables:
    return dataclasses.replace(tables, requests=RequestColumns())


def _power_capped_gpu_1(tables: RunTables) -> RunTables:
    """Clock-event reasons: SW power cap (4) on GPU 1, GPU idle (1) on the others."""
    g = tables.gpu_samples
    index = np.array([gpu for _, gpu in g.keys], dtype=np.int64)[g.k]
    return dataclasses.replace(tables, gpu_samples=dataclasses.replace(
        g, clock_event_reasons=np.where(index == 1, 4.0, 1.0)))


def test_client_bound_from_an_in_flight_gauge(tmp_path: Path) -> None:
    """Without request records the gauge of the client's requests in flight still shows the
    client keeping 8 of 32; without it either, the shortfall cannot be seen."""
    spec = SynthRun([Level("C=32", 32, 8, [0.9] * 4, 2, 10)], pp=4)
    a = _analyse(tmp_path / "gauge", spec, requests_to_gauge)
    assert _causes(a) == {"client_bound"}
    assert 7.5 <= a.findings[0].evidence["inflight_mean"] <= 8.5
    assert any("from a gauge" in note for note in a.run.notes)
    blind = _analyse(tmp_path / "none", spec, _without_requests)
    assert "client_bound" not in _causes(blind)


def test_kv_cache_bound(tmp_path: Path) -> None:
    """Token usage near 1 while requests queue."""
    spec = SynthRun([Level("C=16", 16, 16, [0.95] * 4, 4, 10, queue=5, token_usage=0.97)], pp=4)
    assert _causes(_analyse(tmp_path / "r", spec)) == {"kv_cache_bound"}


def test_throttling_from_clock_event_reasons(tmp_path: Path) -> None:
    """SW power cap reasons on one GPU make a throttling finding for its stage."""
    spec = SynthRun([Level("C=16", 16, 16, [0.95] * 4, 4, 10)], pp=4)
    a = _analyse(tmp_path / "r", spec, _power_capped_gpu_1)
    assert _causes(a) == {"throttling"} and a.findings[0].stages == [1]


def test_log_sampling_aliased(tmp_path: Path) -> None:
    """--decode-log-interval 40 with 8 slots: the log keeps sampling the same slot."""
    spec = SynthRun([Level("C=64", 64, 64, [0.95] * 8, 8, 10)], pp=8, decode_log_interval=40,
                    engine={"max_running_requests": 64, "pp_max_micro_batch_size": 64})
    a = _analyse(tmp_path / "r", spec)
    assert _causes(a) == {"log_sampling_aliased"}
    assert "--decode-log-interval 1" in a.findings[0].recommendation


def test_request_pool_at_its_limit_is_the_bound_not_k(tmp_path: Path) -> None:
    """SGLang PP2, max_running_requests 8 (K = 4 by default), 16 offered: two micro-batches of 4
    run and 8 wait, as real SGLang 0.5.23 did. The pool is the bound (raising K admits nothing):
    `--max-running-requests 16`, and no K finding."""
    spec = SynthRun([Level("C=16", 16, 16, [0.95] * 2, 4, 10, queue=8, token_usage=0.1)], pp=2,
                    engine={"max_running_requests": 8})
    a = _analyse(tmp_path / "r", spec)
    assert "microbatch_cap" not in _causes(a)
    (bound,) = [f for f in a.findings if f.cause == "admission_bound"]
    assert bound.recommendation == "--max-running-requests 16"
    assert (bound.evidence["admission_limit"], bound.evidence["engine_running_estimate"]) == (8, 8.0)


def _admission_bound(pm: PhaseMetrics, engine: EngineSettings) -> Finding:
    """The phase's one admission_bound finding."""
    from gputrace.analysis.diagnose import diagnose

    (bound,) = [f for f in diagnose([pm], engine, 2) if f.cause == "admission_bound"]
    return bound


def _gauge_only_c16(path: Path) -> PhaseMetrics:
    """SGLang PP2 at C=16 with max_running_requests 8 (8 wait), as a phase detected from the
    engine's running + waiting gauges: no asked-for level, a mean of 14.6 and a p90 of 16."""
    spec = SynthRun([Level("C=16", 16, 16, [0.95] * 2, 4, 10, queue=8, token_usage=0.1)], pp=2,
                    engine={"max_running_requests": 8})
    pm = _analyse(path, spec).metrics[0]
    return dataclasses.replace(pm, target_concurrency=None, inflight_mean=14.6, inflight_p90=16.0,
                               source=f"detected from {ENGINE_IN_FLIGHT}")


def test_without_the_clients_level_the_limit_covers_the_gauges_peak(tmp_path: Path) -> None:
    """Without an asked-for level (the load from the engine's running + waiting gauges), the new
    limit covers the gauge's 90th percentile, not its mean, which dips while finished requests are
    replaced (vLLM's gauges at C=16: mean 14.6, most scrapes 16)."""
    gauge_only = _gauge_only_c16(tmp_path / "r")
    engine = EngineSettings(engine="sglang", max_running_requests=8)
    assert _admission_bound(gauge_only, engine).change == Change.of_flag("--max-running-requests", 16)
    asked = dataclasses.replace(gauge_only, target_concurrency=15, inflight_mean=14.6,
                                source="request labels")
    assert _admission_bound(asked, engine).recommendation == "--max-running-requests 15"
    # a level detected in the gauge (its rounded median, 16) covers a mean and a 90th percentile
    # that turnover pulls down (vLLM's gauges at C=16 once: p90 15)
    detected = dataclasses.replace(gauge_only, target_concurrency=16, inflight_mean=14.6, inflight_p90=15.0)
    assert _admission_bound(detected, engine).change == Change.of_flag("--max-running-requests", 16)
    # and where most readings fell at a turnover (vLLM at C=16 with the cores shared: the level
    # found in them read 9), the readings between turnovers that hold the whole level decide
    # (its queue gauge dipped alike: 1.4 waiting on average beside the 8 running)
    dipped = dataclasses.replace(gauge_only, target_concurrency=9, inflight_mean=9.4, inflight_p90=16.0,
                                 stages=[dataclasses.replace(st, queue_req_mean=1.4)
                                         for st in gauge_only.stages])
    assert _admission_bound(dipped, engine).change == Change.of_flag("--max-running-requests", 16)


def test_a_limit_from_the_load_seen_says_it_is_a_lower_bound(tmp_path: Path) -> None:
    """[busy] #27: gauges read at a turnover only read low, so a limit found without the client's
    level is the least to set: its text says "at least 16" and findings.json's evidence flags it;
    with the client's level the text is the flag and value alone."""
    from gputrace.report.document import finding_entry

    gauge_only = _gauge_only_c16(tmp_path / "r")
    engine = EngineSettings(engine="sglang", max_running_requests=8)
    for pm in (gauge_only, dataclasses.replace(gauge_only, target_concurrency=16)):
        bound = _admission_bound(pm, engine)
        assert bound.recommendation.startswith("--max-running-requests 16 ")
        assert "at least 16" in bound.recommendation, bound.recommendation
        assert finding_entry(bound)["evidence"]["limit_is_lower_bound"] is True
    # the cache too small for 16: the KV settings first, then the limit, still a lower bound
    full_cache = dataclasses.replace(gauge_only, stages=[dataclasses.replace(st, token_usage_max=0.6)
                                                         for st in gauge_only.stages])
    assert "at least 16" in _admission_bound(full_cache, engine).recommendation
    marked = dataclasses.replace(gauge_only, target_concurrency=16, inflight_mean=16.0, source="markers")
    asked = _admission_bound(marked, engine)
    assert asked.recommendation == "--max-running-requests 16"
    assert finding_entry(asked)["evidence"]["limit_is_lower_bound"] is False


def test_admission_bound_names_the_kv_setting_when_the_cache_would_not_hold_it(tmp_path: Path) -> None:
    """At token usage 0.6 with 8 running, 16 would need about 1.2 of the cache: the finding says so
    and names the KV settings before the limit."""
    spec = SynthRun([Level("C=16", 16, 16, [0.95] * 2, 4, 10, queue=8, token_usage=0.6)], pp=2,
                    engine={"max_running_requests": 8})
    (bound,) = [f for f in _analyse(tmp_path / "r", spec).findings if f.cause == "admission_bound"]
    assert "--mem-fraction-static" in bound.recommendation and "would not fit" in bound.recommendation
    assert bound.evidence["token_usage_projected"] == 1.2


def test_k_binds_only_while_the_pool_has_rows(tmp_path: Path) -> None:
    """Micro-batches at K = 4 with requests waiting and the pool (64) far from full: the cap."""
    spec = SynthRun([Level("C=16", 16, 16, [0.5] * 2, 4, 10, queue=8)], pp=2,
                    engine={"max_running_requests": 64, "pp_max_micro_batch_size": 4})
    a = _analyse(tmp_path / "r", spec)
    assert "admission_bound" not in _causes(a) and "microbatch_cap" in _causes(a)


def test_a_run_without_scheduler_lines_says_cannot_tell_not_healthy(tmp_path: Path) -> None:
    """A run whose GPU samples show every stage busy but whose engine log gave no scheduler line
    ([robust] #5: "every phase is healthy"): one "cannot tell" per phase names the missing lines
    and what to add, and the report nowhere calls a phase healthy."""
    from gputrace.report.render import write_report

    spec = SynthRun([Level("C=32", 32, 32, [0.95] * 8, 4, 10), Level("C=64", 64, 64, [0.95] * 8, 4, 10)],
                    pp=8, engine={"max_running_requests": 64, "pp_max_micro_batch_size": 64})

    def without_lines(tables: RunTables) -> RunTables:
        events = tables.scheduler_events
        empty = {name: getattr(events, name)[:0] for name in type(events).__dataclass_fields__}
        return dataclasses.replace(tables, scheduler_events=type(events)(**empty))

    a = _analyse(tmp_path / "r", spec, without_lines)
    assert [(f.cause, f.phase, f.evidence["missing"]) for f in a.findings] == [
        ("cannot_tell", "C=32", "scheduler_lines"), ("cannot_tell", "C=64", "scheduler_lines")]
    write_report(a, tmp_path, ["md"])
    text = (tmp_path / "report.md").read_text()
    assert "cannot tell what the engine ran in this phase: no scheduler lines" in text
    assert "follow the engine's log" in text and "healthy" not in text
