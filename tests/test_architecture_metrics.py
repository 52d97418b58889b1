"""The metric contract (gputrace.metric_names) holds the exporters, the dashboard's queries and the
Prometheus importer to one list of names."""

from __future__ import annotations

import re
from collections.abc import Iterable

import pytest

from gputrace import dashboard as dash
from gputrace import metric_names as mn
from gputrace.agent.exporter import GpuCollector
from gputrace.agent.sampling import SampleRing, SamplingLoop
from gputrace.exposition import Metric
from gputrace.gpu.simulated import SimulatedSampler
from gputrace.imports import prometheus as source
from gputrace.live import LiveCollector, LiveState
from gputrace.model import EngineConfig, GpuSample, Marker, RequestRecord, SchedulerEvent
from gputrace.topology import Placement, single_node_placements

# PromQL's lexical pieces, enough to tell metric names from functions, keywords and label names
_TOKEN = re.compile(r"""
    (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<duration>\d+(?:\.\d+)?(?:ms|s|m|h|d|w|y)\b)
  | (?P<number>\d+(?:\.\d+)?(?:e[+-]?\d+)?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<punct>[(){}\[\],]|=~|!~|!=|==|<=|>=|[-+*/%^<>=])
  | (?P<space>\s+)
""", re.VERBOSE)
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
             "and", "or", "unless", "atan2", "inf", "nan"}
_LABEL_LISTS = {"by", "without", "on", "ignoring", "group_left", "group_right"}


def promql_metric_names(expr: str) -> tuple[set[str], list[str]]:
    """The metric names an expression selects, and the regexes of its ``__name__`` matchers."""
    tokens = []
    pos = 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise ValueError(f"cannot tokenise {expr[pos:]!r} in {expr!r}")
        if m.lastgroup != "space":
            tokens.append((m.lastgroup, m.group()))
        pos = m.end()
    names: set[str] = set()
    name_regexes: list[str] = []
    braces = 0  # inside {...}: label matchers
    label_list = False  # inside by (...) and the like: label names
    for i, (kind, text) in enumerate(tokens):
        after = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        if text == "{":
            braces += 1
        elif text == "}":
            braces -= 1
        elif text == ")" and label_list:
            label_list = False
        elif kind == "ident" and braces:
            if text == "__name__" and after in ("=~", "!~") and tokens[i + 2][0] == "string":
                name_regexes.append(tokens[i + 2][1][1:-1])
        elif kind == "ident" and text in _LABEL_LISTS and after == "(":
            label_list = True
        elif kind == "ident" and not label_list and text not in _KEYWORDS and after != "(" \
                and after not in ("by", "without"):  # an aggregation: sum by (x) (...)
            names.add(text)
    return names, name_regexes


def test_the_promql_reader_tells_metrics_from_functions_keywords_and_labels() -> None:
    """Functions, aggregations, grouping labels, matcher labels and string values are not metric names."""
    names, regexes = promql_metric_names(
        'sum by (pp_rank) (rate(a_total{host=~"b_c", run!="x"}[5m] offset 1m)) / on (host) group_left (gpu) '
        'max without (tp_rank) (d:e) > bool 0.5 or count({__name__=~"f_.+"})')
    assert names == {"a_total", "d:e"}
    assert regexes == ["f_.+"]


def test_every_dashboard_query_reads_only_contract_metrics() -> None:
    """Each panel query and variable selector names at least one metric, all of them in the contract."""
    selectors = [q.expr for q in dash.dashboard_queries()] + [v.match for v in dash.variable_queries()]
    assert len(selectors) >= 20
    for expr in selectors:
        names, regexes = promql_metric_names(expr)
        assert names or regexes, expr
        assert names <= mn.BY_NAME.keys(), (expr, names - mn.BY_NAME.keys())
        for regex in regexes:
            assert any(re.fullmatch(regex, name) for name in mn.BY_NAME), (expr, regex)


def test_the_dashboard_contract_is_the_modules() -> None:
    """The dashboard's metric list is made of the module's specs, help texts included."""
    assert all(spec is mn.BY_NAME[spec.name] for spec in dash.METRICS)


def _exported(families: Iterable[Metric]) -> dict[str, tuple[str, str, set[frozenset[str]]]]:
    """Scraped series name -> (type, help, label-name sets)."""
    out: dict[str, tuple[str, str, set[frozenset[str]]]] = {}
    for family in families:
        for sample in family.samples:
            entry = out.setdefault(sample.name, (family.type, family.documentation, set()))
            entry[2].add(frozenset(sample.labels))
    return out


def _check_against_contract(exported: dict[str, tuple[str, str, set[frozenset[str]]]]) -> None:
    for name, (kind, help_text, label_sets) in exported.items():
        spec = mn.BY_NAME[name]
        assert (kind, help_text, label_sets) == (spec.kind, spec.help, {frozenset(spec.labels)}), name


@pytest.mark.parametrize("schema", sorted(mn.DCGM_SCHEMAS))
def test_the_agent_exports_exactly_the_contracts_agent_metrics(schema: str) -> None:
    """Every series of the agent (DCGM names on, in each dcgm-exporter schema, a topology) is in the
    contract with its type, help and labels; every agent metric is exported, DCGM's in the schema
    asked for, unless the simulated GPU lacks its field (NVLink)."""
    sampler = SimulatedSampler("node0", 2, pattern="constant:0.5")
    ring = SampleRing(60 * 10**9)
    loop = SamplingLoop(sampler, ring, 0.1)
    loop.tick()
    collector = GpuCollector(loop.stats, ring, sampler.devices(), "node0", single_node_placements("node0", 2),
                             dcgm_compat=True, dcgm_schema=schema)
    exported = _exported(collector.collect())
    _check_against_contract(exported)
    served = {m.name for m in mn.DCGM_SCHEMAS[schema]}
    other_schemas = {m.name for m in mn.DCGM_ALL} - served
    nvlink = {name for name in served | {m.name for m in mn.GPU_GAUGES}
              if "nvlink" in name.lower()}  # the simulated GPUs have none
    assert exported.keys() == {m.name for m in mn.AGENT_METRICS} - other_schemas - nvlink


def test_the_collector_exports_exactly_the_contracts_collector_metrics() -> None:
    """A live state with engine lines, samples, load and a phase exports every collector metric."""
    now_ns = 1_800_000_000 * 10**9
    live = LiveState("run", [Placement("node0", 0, 0)], window_s=20.0, clock_ns=lambda: now_ns)
    live.inflight_probe = lambda: 8
    live.on_marker(Marker("node0", now_ns - 5 * 10**9, "c8", target_concurrency=8))
    live.on_event(SchedulerEvent(host="node0", source="file:log", engine="sglang", kind="decode", line_no=1,
                                 pp_rank=0, running_req=8, queue_req=0, gen_throughput_tok_s=100.0,
                                 token_usage=0.5, recv_ts_ns=now_ns - 4 * 10**9))
    live.on_samples([GpuSample(host="node0", gpu_index=0, ts_ns=now_ns - 10**9, utilization_ratio=0.5)])
    live.on_config(EngineConfig(host="node0", source="file:log", engine="sglang", line_no=0, pp_size=1,
                                max_running_requests=64))
    live.on_request(RequestRecord(host="client", request_id="r1", start_ns=now_ns - 3 * 10**9,
                                  first_token_ns=now_ns - 29 * 10**8, end_ns=now_ns - 2 * 10**9,
                                  completion_tokens=11, phase="c8"))
    exported = _exported(LiveCollector(live).collect())
    _check_against_contract(exported)
    assert exported.keys() == {m.name for m in mn.COLLECTOR_METRICS}


def test_the_prometheus_importer_reads_what_the_agent_and_collector_export() -> None:
    """The importer's gputrace names are the contract's, and it reads every GPU and engine gauge."""
    read = {*source.GPU_FIELDS, *source.ENGINE_FIELDS, source.TARGET_METRIC, source.INFLIGHT_METRIC,
            source.BUSY_COUNTER,
            *(name for names in source.SERIES_ROLES.values() for name in names)}
    ours = {n for n in read if n.startswith(("gputrace_", "DCGM_"))} - {"DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"}
    assert ours <= mn.BY_NAME.keys()
    agent_and_engine = (*mn.GPU_GAUGES, mn.GPU_ENERGY, mn.GPU_BUSY, *mn.DCGM_GAUGES, *mn.ENGINE_GAUGES)
    assert {m.name for m in agent_and_engine} <= read
