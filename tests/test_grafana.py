"""The Grafana dashboard: generated from gputrace/dashboard.py, valid against Grafana's dashboard
schema (the foundation SDK's JSON schemas, vendored in tests/schemas/grafana), wired to the
provisioned datasource, and every PromQL expression accepted and answered by a real Prometheus."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from conftest import require_binary
from helpers import free_port
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from gputrace import dashboard as dash

ROOT = Path(__file__).resolve().parent.parent
SCHEMAS = Path(__file__).resolve().parent / "schemas" / "grafana"
DATASOURCES = ROOT / "grafana" / "provisioning" / "datasources" / "prometheus.yaml"
PROVIDERS = ROOT / "grafana" / "provisioning" / "dashboards" / "gputrace.yaml"
COMPOSE = ROOT / "deploy" / "docker-compose.yml"
PP_SIZE = 4


def _schema(name: str, definition: str | None = None) -> dict[str, Any]:
    schema: dict[str, Any] = json.loads((SCHEMAS / f"{name}.jsonschema.json").read_text())
    if definition is not None:
        schema = {**schema, "$ref": f"#/definitions/{definition}"}
    return schema


def _schema_errors(board: dict[str, Any]) -> list[str]:
    """Errors of the dashboard model, each panel's plugin options and field config, and each query."""
    errors = [f"dashboard {e.json_path}: {e.message}"
              for e in jsonschema.Draft7Validator(_schema("dashboard")).iter_errors(board)]
    for panel in board["panels"]:
        if panel["type"] == "row":
            continue
        kind, title = panel["type"], panel["title"]
        checks: list[tuple[str, dict[str, Any], Any]] = [
            ("options", _schema(kind, "Options"), panel["options"])]
        if "custom" in panel["fieldConfig"]["defaults"]:
            checks.append(("fieldConfig.custom", _schema(kind, "FieldConfig"),
                           panel["fieldConfig"]["defaults"]["custom"]))
        checks += [(f"target {t['refId']}", _schema("prometheus"), t) for t in panel["targets"]]
        for where, schema, instance in checks:
            errors += [f"{title} {where} {e.json_path}: {e.message}"
                       for e in jsonschema.Draft7Validator(schema).iter_errors(instance)]
    return errors


def test_committed_dashboard_is_the_generated_one() -> None:
    """grafana/dashboard.json is exactly what gputrace/dashboard.py generates (regenerate, don't edit)."""
    assert dash.DASHBOARD_PATH.read_text(encoding="utf-8") == dash.render(dash.build_dashboard())
    assert dash.main(["--check", str(dash.DASHBOARD_PATH)]) == 0


def test_dashboard_validates_against_grafana_schema() -> None:
    """The dashboard, its panels' plugin options and its Prometheus queries pass the SDK's JSON schemas."""
    assert _schema_errors(dash.load_dashboard()) == []


def test_schema_check_rejects_broken_dashboards() -> None:
    """The schema check has teeth: a misspelt key, a bad grid position and a bad option all fail."""
    board = dash.load_dashboard()
    broken = []
    b1 = copy.deepcopy(board)
    b1["panels"][1]["gridpos"] = b1["panels"][1].pop("gridPos")
    broken.append(b1)
    b2 = copy.deepcopy(board)
    b2["panels"][2]["gridPos"]["w"] = 30
    broken.append(b2)
    b3 = copy.deepcopy(board)
    b3["panels"][2]["options"]["legend"]["displayMode"] = "sideways"
    broken.append(b3)
    b4 = copy.deepcopy(board)
    b4["panels"][2]["targets"][0]["exprr"] = b4["panels"][2]["targets"][0].pop("expr")
    broken.append(b4)
    for b in broken:
        assert _schema_errors(b), "a broken dashboard passed the schema check"


def test_dashboard_reads_exactly_the_metric_contract() -> None:
    """Every metric in the contract (gputrace.dashboard.METRICS) is shown, and no other is used."""
    assert dash.metrics_used() == dash.METRIC_NAMES
    assert {m.source for m in dash.METRICS} == {"agent", "collector"}


def test_dashboard_has_the_panels_the_issue_asks_for() -> None:
    """Per-stage utilization as heatmap and lines, running vs in flight, queue, tok/s, bubble, power, PCIe."""
    by_metric: dict[str, set[str]] = {}
    for panel in dash.load_dashboard()["panels"]:
        for target in panel.get("targets", []):
            for name in re.findall(r"gputrace_\w+", target["expr"]):
                by_metric.setdefault(name, set()).add(panel["type"])
    # the heatmap reads the busy signal (SM activity where given), not raw utilization
    assert by_metric["gputrace_gpu_utilization_ratio"] == {"timeseries"}
    assert by_metric["gputrace_stage_busy_ratio"] == {"heatmap", "timeseries"}
    queries = dash.dashboard_queries()
    running = [q for q in queries if "gputrace_engine_running_requests" in q.expr]
    assert running and "by (pp_rank)" in running[0].expr
    same_panel = {q.expr for q in queries if q.panel == running[0].panel}
    assert any("gputrace_load_inflight_requests" in e for e in same_panel)
    for name in ("gputrace_engine_queue_requests", "gputrace_engine_generation_tokens_per_second",
                 "gputrace_stage_bubble_ratio", "gputrace_gpu_power_watts",
                 "gputrace_gpu_pcie_tx_bytes_per_second", "gputrace_gpu_pcie_rx_bytes_per_second"):
        assert "timeseries" in by_metric[name], name
    names = {v.name: v for v in dash.variable_queries()}
    assert set(names) == {"host", "run"}
    assert names["host"].label == "host" and names["run"].label == "run"


def test_datasource_and_provider_provisioning_match_the_dashboard() -> None:
    """The provisioned datasource has the fixed uid every query uses; the provider reads the mounted file."""
    datasources = yaml.safe_load(DATASOURCES.read_text())
    assert datasources["apiVersion"] == 1
    (prom,) = datasources["datasources"]
    assert (prom["uid"], prom["type"]) == (dash.DATASOURCE_UID, "prometheus")
    board = dash.load_dashboard()
    refs = [p["datasource"] for p in board["panels"] if "datasource" in p]
    refs += [t["datasource"] for p in board["panels"] for t in p.get("targets", [])]
    refs += [v["datasource"] for v in board["templating"]["list"]]
    assert refs and all(r == {"type": "prometheus", "uid": prom["uid"]} for r in refs)
    providers = yaml.safe_load(PROVIDERS.read_text())
    (provider,) = providers["providers"]
    assert provider["type"] == "file"
    compose = yaml.safe_load(COMPOSE.read_text())
    mounts = [m.split(":") for m in compose["services"]["grafana"]["volumes"]]
    targets = {target: (COMPOSE.parent / source).resolve() for source, target, *_ in mounts}
    assert targets["/etc/grafana/provisioning"] == ROOT / "grafana" / "provisioning"
    dashboard_mount = [t for t, s in targets.items() if s == dash.DASHBOARD_PATH]
    assert dashboard_mount and Path(dashboard_mount[0]).parent == Path(provider["options"]["path"])


def test_substitute_replaces_variables_and_macros() -> None:
    """Every Grafana variable syntax is substituted; an unknown variable is an error, not a silent '$x'."""
    expr = 'rate(x{host=~"$host", run=~"${run}", a=~"${host:regex}", b="[[run]]"}[$__rate_interval])'
    out = dash.substitute(expr, {"host": "node0", "run": "r1"})
    assert out == 'rate(x{host=~"node0", run=~"r1", a=~"node0", b="r1"}[1m])'
    with pytest.raises(KeyError):
        dash.substitute("x{a=\"$nope\"}")
    assert all("$" not in q.expr for q in dash.dashboard_queries())


# ---- a real Prometheus -------------------------------------------------------------------------



def _get(url: str) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            body: dict[str, Any] = json.loads(resp.read())
            return body
    except urllib.error.HTTPError as exc:  # 400 carries Prometheus' own error body
        body = json.loads(exc.read())
        return body


def _label_values(base: str, variable: dash.VariableQuery) -> dict[str, Any]:
    query = urllib.parse.urlencode({"match[]": variable.match})
    return _get(f"{base}/api/v1/label/{variable.label}/values?{query}")


def _query(base: str, expr: str) -> dict[str, Any]:
    return _get(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))


def _start_prometheus(tmp: Path, targets: list[str]) -> Iterator[str]:
    binary = require_binary("prometheus", "/usr/bin/prometheus")
    config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
              "scrape_configs": [{"job_name": "contract", "static_configs": [{"targets": targets}]}]
              if targets else []}
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    with (tmp / "prometheus.log").open("wb") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [binary, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=log)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{base}/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("prometheus did not start: " + (tmp / "prometheus.log").read_text())
            time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
def empty_prometheus(tmp_path: Path) -> Iterator[str]:
    yield from _start_prometheus(tmp_path, [])


@pytest.mark.system
def test_every_promql_expression_parses(empty_prometheus: str) -> None:
    """A real Prometheus with an empty TSDB accepts every panel query and variable selector."""
    queries = dash.dashboard_queries()
    assert len(queries) >= 15
    for q in queries:
        result = _query(empty_prometheus, q.expr)
        assert result["status"] == "success", f"{q.panel} {q.ref_id}: {q.expr}: {result.get('error')}"
    for v in dash.variable_queries():
        assert _label_values(empty_prometheus, v)["status"] == "success", v
    bad = _query(empty_prometheus, "sum by (pp_rank (gputrace_gpu_power_watts)")
    assert bad["status"] == "error" and bad["errorType"] == "bad_data"


def _contract_registry() -> CollectorRegistry:
    """Every metric of the contract with its labels, as a PP4 deployment on one host would export it."""
    registry = CollectorRegistry()
    label_values = {"host": "node0", "uuid": "GPU-0", "model": "NVIDIA H200", "tp_rank": "0",
                    "dp_rank": "0", "run": "contract", "signal": "SM activity (GPM)", "phase": "C=8",
                    "quantile": "0.5", "cause": "pipeline_underfilled",
                    "finding": "pipeline_underfilled: 2 micro-batches in flight for 4 stages"}
    for spec in dash.METRICS:
        if spec.kind == "counter":
            metric: Any = Counter(spec.name.removesuffix("_total"), spec.help, spec.labels, registry=registry)
        else:
            metric = Gauge(spec.name, spec.help, spec.labels, registry=registry)
        stages = range(PP_SIZE) if {"pp_rank", "gpu"} & set(spec.labels) else [0]
        for stage in stages:
            labels = {**label_values, "gpu": str(stage), "pp_rank": str(stage)}
            child = metric.labels(**{k: labels[k] for k in spec.labels}) if spec.labels else metric
            if spec.kind == "counter":
                child.inc(1000.0 + stage)
            else:
                child.set(0.25 + stage / 10)
    return registry


@pytest.fixture
def contract_prometheus(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=_contract_registry())
    try:
        yield from _start_prometheus(tmp_path, [f"127.0.0.1:{port}"])
    finally:
        server.shutdown()
        thread.join(timeout=5)


@pytest.mark.system
def test_every_query_returns_data_for_the_metric_contract(contract_prometheus: str) -> None:
    """Scraping the contract's names and labels, every query returns series, one per stage where per stage."""
    pending = {(q.panel, q.ref_id): q for q in dash.dashboard_queries()}
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    deadline = time.monotonic() + 30  # increase() needs two scrapes in its window
    while pending and time.monotonic() < deadline:
        for key, q in list(pending.items()):
            result = _query(contract_prometheus, q.expr)
            assert result["status"] == "success", q.expr
            if result["data"]["result"]:
                results[key] = result["data"]["result"]
                del pending[key]
        time.sleep(0.5)
    assert not pending, f"no data for: {[q.expr for q in pending.values()]}"
    for q in dash.dashboard_queries():
        series = results[(q.panel, q.ref_id)]
        if q.expr.startswith(("sum by (pp_rank)", "avg by (pp_rank)", "max by (pp_rank)",
                              "gputrace_stage_bubble_ratio")):
            assert sorted(s["metric"]["pp_rank"] for s in series) == [str(i) for i in range(PP_SIZE)], q
    for v in dash.variable_queries():
        assert _label_values(contract_prometheus, v)["data"] == [{"host": "node0", "run": "contract"}[v.name]]


# ---- the real agent ----------------------------------------------------------------------------


@pytest.fixture
def sim_agent(tmp_path: Path) -> Iterator[str]:
    """`gputrace agent --backend sim` on loopback, 4 simulated GPUs as a PP4 pipeline."""
    port = free_port()
    with (tmp_path / "agent.log").open("wb") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [sys.executable, "-m", "gputrace", "agent", "--backend", "sim", "--listen", f"127.0.0.1:{port}",
             "--interval", "0.1", "--sim-gpus", str(PP_SIZE), "--topology", f"pp={PP_SIZE},tp=1",
             "--host-name", "node0"], stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{url}/healthz", timeout=2):
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("agent did not start: " + (tmp_path / "agent.log").read_text())
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_real_agent_exports_the_contract(sim_agent: str) -> None:
    """The agent's /metrics has every agent metric of the contract, with exactly its labels."""
    with urllib.request.urlopen(f"{sim_agent}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    labels: dict[str, set[frozenset[str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels.setdefault(sample.name, set()).add(frozenset(sample.labels))
    for spec in dash.METRICS:
        if spec.source == "agent":
            assert labels.get(spec.name) == {frozenset(spec.labels)}, spec.name


@pytest.fixture
def agent_prometheus(sim_agent: str, tmp_path: Path) -> Iterator[str]:
    yield from _start_prometheus(tmp_path, [sim_agent.removeprefix("http://")])


@pytest.mark.system
def test_gpu_queries_return_data_from_a_real_agent(agent_prometheus: str) -> None:
    """Prometheus scraping the real sim agent answers every GPU-side panel query, one series per stage."""
    agent_names = {m.name for m in dash.METRICS if m.source == "agent"}
    gpu_queries = [q for q in dash.dashboard_queries()
                   if set(re.findall(r"gputrace_\w+", q.expr)) <= agent_names]
    assert len(gpu_queries) >= 10
    pending = {(q.panel, q.ref_id): q for q in gpu_queries}
    deadline = time.monotonic() + 30
    while pending and time.monotonic() < deadline:
        for key, q in list(pending.items()):
            result = _query(agent_prometheus, q.expr)
            assert result["status"] == "success", q.expr
            series = result["data"]["result"]
            if series:
                if q.expr.startswith("avg by (pp_rank)"):
                    assert sorted(s["metric"]["pp_rank"] for s in series) == [str(i) for i in range(PP_SIZE)]
                del pending[key]
        time.sleep(0.5)
    assert not pending, f"no data for: {[q.expr for q in pending.values()]}"
    host = next(v for v in dash.variable_queries() if v.name == "host")
    assert _label_values(agent_prometheus, host)["data"] == ["node0"]


def test_the_dashboard_shows_what_the_verdict_rests_on() -> None:
    """Micro-batches in flight beside pp_size, the engine's running total beside its pool, busy
    and bubble with the signal, TTFT/ITL in one panel each; the load phases as annotations from
    the collector's markers (their start time as the value: Grafana's useValueForTime)."""
    panels: dict[str, set[str]] = {}
    for q in dash.dashboard_queries():
        panels.setdefault(q.panel, set()).update(re.findall(r"gputrace_\w+", q.expr))
    together = [{"gputrace_engine_microbatches_in_flight", "gputrace_engine_pipeline_stages"},
                {"gputrace_engine_total_running_requests", "gputrace_engine_max_running_requests"},
                {"gputrace_stage_busy_ratio", "gputrace_stage_bubble_ratio"},
                {"gputrace_load_ttft_seconds", "gputrace_load_itl_seconds"}]
    for names in together:
        assert any(names <= used for used in panels.values()), names
    busy = next(q for q in dash.dashboard_queries() if q.panel == "Busy and bubble per stage")
    assert "{{signal}}" in busy.legend
    phases = [a for a in dash.load_dashboard()["annotations"]["list"] if "expr" in a]
    assert len(phases) == 1 and phases[0]["useValueForTime"]
    assert "gputrace_load_phase_start_seconds" in phases[0]["expr"] and phases[0]["expr"].endswith("* 1000")
    assert phases[0]["titleFormat"] == "phase {{phase}}"


def test_legend_text_fills_labels_as_grafana_does() -> None:
    """A legend format's {{label}} takes the series' value (empty where it lacks the label); no
    format gives the series as PromQL writes it."""
    labels = {"__name__": "gputrace_stage_busy_ratio", "pp_rank": "3", "signal": "SM activity (GPM)"}
    assert dash.legend_text("busy, stage {{pp_rank}} ({{ signal }}){{host}}", labels) == \
        "busy, stage 3 (SM activity (GPM))"
    assert dash.legend_text("", labels) == \
        'gputrace_stage_busy_ratio{pp_rank="3", signal="SM activity (GPM)"}'


def test_panels_without_a_prometheus_says_so_in_one_line(tmp_path: Path) -> None:
    """`gputrace panels` against a port nothing listens on: one line naming it, exit 1, nothing written."""
    url = f"http://127.0.0.1:{free_port()}"
    out = subprocess.run([sys.executable, "-m", "gputrace", "panels", "--prometheus", url, "--out",
                          str(tmp_path / "panels")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [f"gputrace: error: Prometheus {url} unreachable: "
                                               "[Errno 111] Connection refused"]
    assert not (tmp_path / "panels").exists()
