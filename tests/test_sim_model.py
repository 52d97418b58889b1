"""The simulator in virtual time: determinism, ground truth, parsed log lines, nvidia-smi CSV, overrides."""

from __future__ import annotations

import collections
import re

import numpy as np
import pyarrow as pa
import pytest

from gputrace.errors import ConfigError, UsageError
from gputrace.imports.nvidia_smi import parse_query_csv
from gputrace.model import RECORD_TABLES, SchedulerEvent
from gputrace.sim import SCENARIOS, run_scenario, scenario_params
from gputrace.sim.outputs import parse_log, write_gpu_csv, write_log, write_store
from gputrace.sim.params import load_params_file, parse_set_options
from gputrace.store import Store

SHORT_CAP = {"phase_s": 30.0, "max_tokens": 256, "drain_s": 5.0}
SHORT = {"phase_s": 8.0, "drain_s": 2.0, "max_tokens": 256}


def _write_all(result, base):
    base.mkdir()
    write_log(result, base / "sched.log")
    write_gpu_csv(result, base / "gpu.csv")
    write_store(result, base / "run")
    return base


def _tables(path):
    with Store.open(path, read_only=True) as store:
        return {t: store.arrow(t) for t in RECORD_TABLES.values()}


def test_same_seed_gives_byte_identical_outputs(tmp_path):
    """Two runs with one seed write the same log, CSV, meta.json bytes and store rows."""
    a = _write_all(run_scenario("healthy", 3, SHORT), tmp_path / "a")
    b = _write_all(run_scenario("healthy", 3, SHORT), tmp_path / "b")
    for name in ("sched.log", "gpu.csv", "run/meta.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    ta, tb = _tables(a / "run"), _tables(b / "run")
    for table in RECORD_TABLES.values():
        # the simulator writes every request; an in-flight gauge (load_samples) stands in for them
        # only in imports that lack them
        assert ta[table].num_rows > 0 or table == "load_samples", table
        assert ta[table].equals(tb[table]), table


def test_another_seed_gives_another_run():
    """The seed drives the random parts (prompt and output lengths), so another seed differs."""
    a = run_scenario("healthy", 1, SHORT)
    b = run_scenario("healthy", 2, SHORT)
    assert [r.output_tokens for r in a.requests] != [r.output_tokens for r in b.requests]


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_parser_recognises_every_simulated_line(scenario, tmp_path):
    """Every line each scenario logs is recognised by gputrace's SGLang parser, also via `import`."""
    # the burst's 32 prompts of 1,024 tokens prefill for about 10 s before its first decode
    overrides = SHORT_CAP if scenario.startswith(("microbatch", "prefill-burst")) else SHORT
    result = run_scenario(scenario, 0, overrides)
    events, configs, unrecognised = parse_log(result)
    assert unrecognised == 0
    assert len(events) + len(configs) == len(result.log_lines)
    kinds = {e.kind for e in events}
    p = result.params
    if p.engine == "vllm":  # one stats line per interval for the whole engine, no PP rank
        assert kinds == {"stats"} and {e.pp_rank for e in events} == {None}
    else:
        assert kinds == {"decode", "prefill"}
        assert {e.pp_rank for e in events} == set(range(p.pp_size))
    assert any(c.pp_size == p.pp_size and c.max_running_requests == p.max_running_requests for c in configs)
    # The store holds what the per-line parser gives, each event stamped with its line's time.
    write_store(result, tmp_path / "run")
    with Store.open(tmp_path / "run", read_only=True) as store:
        stored = store.sql("SELECT * FROM scheduler_events ORDER BY line_no")
    names = [f for f in SchedulerEvent.__dataclass_fields__]
    assert stored == [tuple(getattr(e, n) for n in names) for e in events]


def test_prefix_carries_tp_rank_when_tp_above_one():
    """With TP > 1 the prefix is `PPp TP0` and the startup line comes from every rank."""
    result = run_scenario("healthy", 0, {**SHORT, "pp_size": 4, "tp_size": 2, "concurrency": (32,),
                                         "max_running_requests": 32})
    batch = [line for line in result.log_lines if "Decode batch" in line]
    assert batch and all(" TP0] " in line and " PP" in line for line in batch)
    startup = [line for line in result.log_lines if "max_total_num_tokens=" in line]
    assert len(startup) == 8
    events, _, unrecognised = parse_log(result)
    assert unrecognised == 0 and {e.tp_rank for e in events} == {0}


def test_ground_truth_is_consistent_with_samples_and_schedule(tmp_path):
    """busy + bubble + idle-without-work = 1; the samples' utilization agrees with busy; with K = 2
    below the pool of 64, at C=32 every one of the 8 slots holds K: 16 run, the rest wait, and
    each stage's log says #running-req 2 (one micro-batch, never the engine's total)."""
    result = run_scenario("microbatch-cap", 0, SHORT_CAP)
    write_store(result, tmp_path / "run")
    with Store.open(tmp_path / "run", read_only=True) as store:
        gt = store.meta.extra["ground_truth"]
        samples = store.columns("gpu_samples", order_by="ts_ns, gpu_index")
        events = store.records(SchedulerEvent, where="kind = 'decode'")
    assert gt["scenario"] == "microbatch-cap" and gt["causes"] == ["microbatch_cap"]
    pp = result.params.pp_size
    for ph in gt["phases"]:
        inside = (samples["ts_ns"] > ph["start_ns"]) & (samples["ts_ns"] <= ph["end_ns"])
        for st in ph["stages"]:
            busy, bubble = st["busy_fraction"], st["bubble_fraction"]
            assert 0.0 <= busy <= 1.0 and bubble >= 0.0
            assert busy + bubble <= 1.0 + 1e-9
            util = samples["utilization_ratio"][inside & (samples["gpu_index"] == st["pp_rank"])]
            assert abs(float(util.mean()) - busy) < 0.01
            if ph["target_concurrency"] >= 8:  # the engine always holds work: no idle without it
                assert busy + bubble == pytest.approx(1.0, abs=0.01)
    c32 = next(ph for ph in gt["phases"] if ph["label"] == "C=32")
    assert c32["causes"] == ["microbatch_cap"]
    k = result.params.micro_batch_cap
    assert k == 2 and c32["running_max"] == k * pp and c32["queue_mean"] > 8
    assert c32["microbatches_in_flight"] == pytest.approx(pp, abs=0.1)
    for st in c32["stages"]:
        assert st["max_microbatch_size"] == k
    # The log says what the model did: #running-req 2 on every stage during C=32, a queue behind.
    in_c32 = [e for e in events if c32["start_ns"] + 10**9 < e.recv_ts_ns < c32["end_ns"]]
    assert {e.pp_rank for e in in_c32} == set(range(pp))
    assert {e.running_req for e in in_c32} == {k}
    assert all(e.queue_req and e.queue_req > 0 for e in in_c32)


def test_ground_truth_names_each_scenarios_cause():
    """Each single-cause scenario shows its cause in every phase; healthy shows none."""
    for name, overrides in (("healthy", {}), ("stage-imbalance", {}), ("client-bound", {}),
                            ("kv-bound", {}), ("pcie-bound", {}), ("log-aliased", {})):
        result = run_scenario(name, 0, {"phase_s": 40.0, "drain_s": 2.0, **overrides})
        expected = list(SCENARIOS[name].causes)
        for ph in result.ground_truth["phases"]:
            assert ph["causes"] == expected, (name, ph["label"], ph["causes"])


def test_store_layout_follows_the_ground_truth_conventions(tmp_path):
    """Hosts, devices, markers, clock probes, configs and topology as the conventions say."""
    result = run_scenario("microbatch-fixed", 0, SHORT_CAP)
    write_store(result, tmp_path / "run")
    with Store.open(tmp_path / "run", read_only=True) as store:
        meta = store.meta
        assert meta.topology["source"] == "simulator" and meta.topology["pp_size"] == 8
        assert store.sql("SELECT DISTINCT host FROM gpu_samples") == [("sim-node0",)]
        assert store.sql("SELECT DISTINCT host FROM requests") == [("sim-client",)]
        devices = store.sql("SELECT gpu_index, pcie_max_gen, pcie_max_width, power_limit_w FROM devices "
                            "ORDER BY gpu_index")
        assert [d[0] for d in devices] == list(range(8)) and all(d[1] and d[2] and d[3] for d in devices)
        markers = store.sql("SELECT label, kind, target_concurrency FROM markers ORDER BY ts_ns")
        assert markers == [("C=1", "phase", 1), ("C=8", "phase", 8), ("C=32", "phase", 32),
                           ("C=64", "phase", 64), ("end", "end", None)]
        offsets = store.sql("SELECT DISTINCT remote_ns - (local_send_ns + local_recv_ns) / 2 "
                            "FROM clock_probes")
        assert offsets == [(0.0,)]
        cfg = store.sql("SELECT pp_size, tp_size, max_running_requests, pp_max_micro_batch_size, "
                        "pp_async_batch_depth, decode_log_interval FROM engine_configs "
                        "WHERE pp_size IS NOT NULL")
        assert cfg == [(8, 1, 64, result.params.pp_max_micro_batch_size, 0, 9)]
        ev = store.sql("SELECT count(*), min(ts_resolution_ns), count(recv_ts_ns), "
                       "max(recv_ts_ns - log_ts_ns) FROM scheduler_events")[0]
        assert ev[0] > 0 and ev[1] == 10**9 and ev[2] == ev[0] and 0 <= ev[3] < 10**9
        phases = store.sql("SELECT phase, count(*) FROM requests GROUP BY 1 ORDER BY 1")
        assert {p for p, _ in phases} == {"C=1", "C=8", "C=32", "C=64"}
        rates = store.columns("gpu_samples")["pcie_tx_bytes_per_s"]
        assert np.nanmax(rates) > 0


def test_gpu_csv_is_nvidia_smi_query_format(tmp_path):
    """The CSV has nvidia-smi's header and units and imports with no bad row."""
    result = run_scenario("healthy", 0, SHORT)
    path = tmp_path / "gpu.csv"
    rows = write_gpu_csv(result, path)
    lines = path.read_text().splitlines()
    assert lines[0].startswith("timestamp, index, name, utilization.gpu [%], utilization.memory [%], "
                               "power.draw [W], memory.used [MiB]")
    assert lines[1].split(", ")[3].endswith(" %") and lines[1].split(", ")[5].endswith(" W")
    parsed = parse_query_csv(path, host="sim-node0")
    assert parsed.bad == 0 and len(parsed.records) == rows == len(lines) - 1


def test_overrides_from_set_options_and_toml(tmp_path):
    """--set values and TOML tables are checked and coerced by field; unknown names fail clearly."""
    sets = parse_set_options(["pp_max_micro_batch_size=32", "concurrency=2,4", "stage_cost_multipliers="
                              "1,1,1,2,1,1,1,1", "client_max_inflight=none"])
    p = scenario_params("microbatch-cap", sets)
    assert p.pp_max_micro_batch_size == 32 and p.concurrency == (2, 4)
    assert p.stage_cost_multipliers[3] == 2.0 and p.client_max_inflight is None
    toml = tmp_path / "sim.toml"
    toml.write_text("[sim]\npp_size = 4\nmax_running_requests = 32\nconcurrency = [1, 16]\n")
    p = scenario_params("healthy", load_params_file(toml))
    assert (p.pp_size, p.micro_batch_cap, p.concurrency) == (4, 8, (1, 16))
    with pytest.raises(ConfigError, match="unknown simulator parameter 'pp_sise'"):
        scenario_params("healthy", {"pp_sise": 4})
    with pytest.raises(ConfigError, match="stage_cost_multipliers"):
        scenario_params("healthy", {"stage_cost_multipliers": "1,2"})
    with pytest.raises(UsageError, match="unknown scenario"):
        scenario_params("nope")
    with pytest.raises(UsageError, match="key=value"):
        parse_set_options(["pp_size"])


def test_microbatch_scope_cap_fills_slots_at_most_k():
    """With SGLang's per-micro-batch reading of the cap, no decode micro-batch exceeds K."""
    result = run_scenario("healthy", 0, {**SHORT, "concurrency": (80,)})
    iv = result.intervals
    assert iv["reqs"][iv["decode"]].max() == result.params.micro_batch_cap == 8
    ph = result.ground_truth["phases"][0]
    assert ph["running_max"] <= result.params.max_running_requests
    assert ph["queue_mean"] > 0  # 80 offered, 64 may run


def test_arrow_table_contents_are_sorted_in_time():
    """Log lines are in time order and their prefix second matches the emission time."""
    result = run_scenario("microbatch-cap", 0, SHORT_CAP)
    ts = np.asarray(result.log_ts_ns)
    assert np.all(np.diff(ts) >= 0)
    events, _, _ = parse_log(result)
    log_ts = np.array([e.log_ts_ns for e in events])
    recv = np.array([e.recv_ts_ns for e in events])
    assert np.all(log_ts == recv // 10**9 * 10**9)
    assert pa.array(recv).null_count == 0


def test_nccl_spin_fills_utilization_but_not_sm_activity(tmp_path):
    """[sim] Must show 4 (SM activity; the engine's fwd occupancy line is not modelled yet): with
    nccl_spin, a rank waiting for its input reads utilization ~100 % while SM activity, and power,
    follow the true compute share; without it both read the compute share."""
    overrides = {"pp_max_micro_batch_size": 64, "concurrency": (32,), "phase_s": 20.0, "drain_s": 2.0}
    power = {}
    for spinning in (True, False):
        result = run_scenario("bunched", 0, {**overrides, "nccl_spin": spinning})
        write_store(result, tmp_path / f"run-{spinning}")
        with Store.open(tmp_path / f"run-{spinning}", read_only=True) as store:
            cols = store.columns("gpu_samples")
        ph = result.ground_truth["phases"][0]
        inside = (cols["ts_ns"] > ph["start_ns"] + 10**9) & (cols["ts_ns"] <= ph["end_ns"])
        for st in ph["stages"]:
            mine = inside & (cols["gpu_index"] == st["pp_rank"])
            assert st["busy_fraction"] < 0.3  # one or two micro-batches for 8 stages: mostly waiting
            util = float(cols["utilization_ratio"][mine].mean())
            sm = float(cols["sm_active_ratio"][mine].mean())
            assert abs(sm - st["busy_fraction"]) < 0.01
            assert util > 0.99 if spinning else abs(util - st["busy_fraction"]) < 0.01
        power[spinning] = float(np.asarray(cols["power_w"])[inside].mean())
    assert abs(power[True] - power[False]) < 2.0  # spinning draws no compute power


def test_the_device_timer_tail_gives_each_ranks_true_compute_share():
    """[sim] Must show 4, the engine's own figure: with device_timer (SGLang's
    SGLANG_ENABLE_METRICS_DEVICE_TIMER=1) each batch line ends with `fwd occupancy: X%, fwd+idle
    occupancy: Y%`; the forward time they add up to over a phase is the rank's true busy share,
    NCCL spin or not, and the parser still reads every line."""
    result = run_scenario("bunched", 0, {"pp_max_micro_batch_size": 64, "concurrency": (32,), "phase_s": 20.0,
                                         "drain_s": 2.0, "nccl_spin": True, "device_timer": True,
                                         "decode_log_interval": 1})
    _, _, unrecognised = parse_log(result)
    assert unrecognised == 0
    tail = re.compile(r"PP(\d)\] .*fwd occupancy: ([\d.]+)%, fwd\+idle occupancy: ([\d.]+)%$")
    ph = result.ground_truth["phases"][0]
    last: dict[int, int] = {}
    fwd_ns: dict[int, float] = collections.defaultdict(float)
    for line, ts in zip(result.log_lines, result.log_ts_ns, strict=True):
        m = tail.search(line)
        if m is None:
            continue
        rank = int(m.group(1))
        if rank in last and ph["start_ns"] <= last[rank] and ts <= ph["end_ns"]:
            fwd_ns[rank] += float(m.group(2)) / 100 * (ts - last[rank])
        last[rank] = ts
    span_ns = ph["end_ns"] - ph["start_ns"]
    for st in ph["stages"]:
        assert abs(fwd_ns[st["pp_rank"]] / span_ns - st["busy_fraction"]) < 0.02, (st, fwd_ns[st["pp_rank"]])


def test_a_burst_level_ends_when_its_last_request_finishes():
    """client_mode "burst" (how the motivating figures were measured): each level sends its C
    requests at once; it ends when the last one is back, the next level starts then, and the
    throughput is all the level's tokens over that wall time."""
    from gputrace.sim.simulate import BURST_STEP_S

    result = run_scenario("motivating", 0, {"client_mode": "burst", "concurrency": (1, 8), "max_tokens": 64,
                                            "drain_s": 0.0})
    p = result.params
    for phase, truth in zip(result.phases, result.ground_truth["phases"], strict=True):
        mine = [r for r in result.requests if r.phase == phase.label]
        assert len(mine) == phase.target_concurrency
        assert all(r.client_start_s == phase.start_s for r in mine)
        last = max(r.finish_s for r in mine if r.finish_s is not None)
        assert phase.end_s == pytest.approx(last + p.client_latency_s)
        tokens = sum(r.generated for r in mine)
        assert truth["throughput_tok_s"] == pytest.approx(tokens / (phase.end_s - phase.start_s), rel=0.01)
    # the next level goes out then, or at the engine's clock where its loop ran past the end (at
    # most one BURST_STEP_S: a burst sent in the engine's past would land all at once)
    assert result.phases[0].end_s <= result.phases[1].start_s <= result.phases[0].end_s + BURST_STEP_S


def _tokens_per_batch(result, label: str) -> float:  # type: ignore[no-untyped-def]
    """Tokens out of the last stage per batch stage 0 ran, over a phase (its first second left out)."""
    tr = result.engine.trace
    (ph,) = [p for p in result.phases if p.label == label]
    starts = np.asarray(tr.iv_start).reshape(-1, result.params.pp_size)[:, 0]
    batches = ((starts >= ph.start_s + 1) & (starts < ph.end_s)).sum()
    t, n = np.asarray(tr.tok_t), np.asarray(tr.tok_n)
    return float(n[(t >= ph.start_s + 1) & (t < ph.end_s)].sum() / batches)


@pytest.mark.parametrize(("limit", "per_batch"), [(8, 8.0), (16, 16.0)])
def test_a_levels_new_requests_join_the_batch_stage_0_waits_on(limit: int, per_batch: float) -> None:
    """vLLM takes new requests in between steps: with a batch in flight and nothing else to
    schedule it blocks on that batch, and what arrives meanwhile joins it when it returns. Real
    vLLM 0.32.0 at PP=2 on this CPU (max_num_seqs 8, C = 1, 4, 16, 96 tokens) ran 1.0, 3.96 and
    8.0 generation tokens per iteration (`vllm:iteration_tokens_total`), and at max_num_seqs 16
    under C=16 most iterations held 9 to 16: one batch in flight. The simulator issued the level's
    new requests in a second batch (4 + 4 at C=16) when stage 0's wait ran past the driver's
    horizon, before the driver had added them."""
    result = run_scenario("healthy", 0, {
        "engine": "vllm", "pp_size": 2, "max_running_requests": limit, "concurrency": (1, 4, 16),
        "phase_s": 10.0, "max_tokens": 96, "input_tokens": 34, "launch_s": 0.004, "weight_read_s": 0.0,
        "decode_token_s": 7.5e-4, "client_latency_s": 0.002})
    assert _tokens_per_batch(result, "C=4") == pytest.approx(4.0, abs=0.1)
    assert _tokens_per_batch(result, "C=16") == pytest.approx(per_batch, abs=0.5)


@pytest.mark.parametrize("scenario", ["microbatch-cap", "kv-bound", "log-aliased", "vllm-admission"])
def test_a_run_without_its_log_text_has_the_same_ground_truth(scenario: str) -> None:
    """Runs read only for their truth (a fix's, an advice's, a calibration figure's) skip the log
    text: the same run, the same truth."""
    from gputrace.sim.virtual import run_params

    p = scenario_params(scenario, {"phase_s": 20.0, "seed": 1})
    logged, unlogged = run_params(p, scenario), run_params(p, scenario, log=False)
    assert logged.log_lines and not unlogged.log_lines
    assert unlogged.ground_truth == logged.ground_truth


@pytest.mark.parametrize("scenario", ["microbatch-cap", "kv-bound", "stage-imbalance", "prefill-chunk"])
def test_the_engines_unlogged_stage_walk_gives_the_logged_walks_trace(scenario: str) -> None:
    """A replay (no log) takes the engine's fast walk through the stages, a run with its log the
    walk that writes the lines: the same arithmetic, so the same trace, bit for bit."""
    from gputrace.sim.engine import PipelineEngine
    from gputrace.sim.virtual import run_params

    p = scenario_params(scenario, {"phase_s": 15.0, "seed": 2, "queued_request_s": 2e-4,
                                   "context_token_s": 1e-7})
    walked = 0
    original = PipelineEngine._run_stages_logged

    def counting(self: PipelineEngine, *args: object) -> float:
        nonlocal walked
        walked += 1
        return original(self, *args)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(PipelineEngine, "_run_stages_logged", counting)
        unlogged = run_params(p, scenario, log=False)
        assert walked == 0
        logged = run_params(p, scenario)
    a, b = logged.engine.trace, unlogged.engine.trace
    assert logged.log_lines and walked == len(a.step_reqs) > 500
    for column in ("iv_start", "iv_end", "step_reqs", "tok_t", "tok_n", "st_t", "st_running", "work_t"):
        assert getattr(a, column) == getattr(b, column), column
