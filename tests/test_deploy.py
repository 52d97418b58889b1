"""deploy/: the systemd units pass `systemd-analyze verify` and its security review, the compose file
passes the Compose Specification's schema, the Kubernetes manifests pass the Kubernetes API schemas
(and the prometheus-operator CRD models), the scrape config passes promtool, and every command line
uses the gputrace CLI as specified."""

from __future__ import annotations

import copy
import importlib
import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import kubernetes_validate
import pytest
import yaml
from cloudcoil.models.prometheus_operator.v1 import ServiceMonitor
from conftest import require_binary

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))
COMPOSE = DEPLOY / "docker-compose.yml"
PROMETHEUS_YML = DEPLOY / "prometheus.yml"
DAEMONSET = DEPLOY / "kubernetes" / "agent-daemonset.yaml"
SERVICEMONITOR = DEPLOY / "kubernetes" / "servicemonitor.yaml"
INSTALLED_BINARY = "/usr/local/bin/gputrace"
AGENT_PORT, COLLECTOR_PORT = 9402, 9401

# The CLI as issues 4 and 6 specify it, plus the agent's labelling options: option -> takes a value.
CLI_SPEC: dict[str, dict[str, bool]] = {
    "agent": {"--listen": True, "--interval": True, "--buffer": True, "--backend": True,
              "--token-file": True, "--tls-cert": True, "--tls-key": True, "--dcgm-compat": False,
              "--insecure": False, "--host-name": True, "--topology": True, "--sim-gpus": True},
    "collect": {"--config": True, "--out": True, "--listen": True},
}


def _unit_directives(path: Path) -> dict[str, list[str]]:
    """Directive -> values in file order (systemd allows repeats); comments skipped."""
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            key, value = line.split("=", 1)
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def _verify(tmp: Path, unit_text: str, name: str) -> subprocess.CompletedProcess[str]:
    """systemd-analyze verify on a copy whose ExecStart binary is this checkout's installed gputrace
    (verify insists that the binary exists; only the install prefix differs)."""
    binary = require_binary("systemd-analyze")
    gputrace = Path(sys.executable).parent / "gputrace"
    assert gputrace.exists(), "gputrace is not installed in this environment"
    unit = tmp / name
    unit.write_text(unit_text.replace(INSTALLED_BINARY, str(gputrace)))
    return subprocess.run([binary, "verify", str(unit)], capture_output=True, text=True, timeout=60, cwd=tmp)


@pytest.mark.system
@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_systemd_unit_passes_verify(unit: Path, tmp_path: Path) -> None:
    """systemd-analyze verify exits 0 and prints nothing: no unknown directive, no bad value."""
    result = _verify(tmp_path, unit.read_text(), unit.name)
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


@pytest.mark.system
def test_systemd_verify_reports_a_misspelt_directive(tmp_path: Path) -> None:
    """The verify check has teeth: a misspelt hardening directive is reported."""
    text = (DEPLOY / "systemd" / "gputrace-agent.service").read_text()
    result = _verify(tmp_path, text.replace("ProtectHome=yes", "ProtectHomes=yes"), "gputrace-agent.service")
    assert "Unknown key 'ProtectHomes'" in result.stdout + result.stderr


@pytest.mark.system
@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_systemd_unit_security_review_is_ok(unit: Path, tmp_path: Path) -> None:
    """systemd-analyze security rates the unit's exposure 'OK' (below 2.0 of 10)."""
    binary = require_binary("systemd-analyze")
    copy_path = tmp_path / unit.name
    copy_path.write_text(unit.read_text())
    result = subprocess.run([binary, "security", "--offline=true", str(copy_path)], capture_output=True,
                            text=True, timeout=60, cwd=tmp_path)
    match = re.search(r"Overall exposure level for \S+: ([0-9.]+) (\w+)", result.stdout)
    assert match, result.stdout + result.stderr
    assert float(match.group(1)) < 2.0 and match.group(2) == "OK", result.stdout


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_systemd_unit_is_hardened(unit: Path) -> None:
    """Dynamic user, read-only system, no capabilities, syscall filter, restricted sockets."""
    d = _unit_directives(unit)
    required = {"DynamicUser": "yes", "ProtectSystem": "strict", "ProtectHome": "yes",
                "NoNewPrivileges": "yes", "PrivateTmp": "yes", "CapabilityBoundingSet": "",
                "AmbientCapabilities": "",
                "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6", "SystemCallArchitectures": "native",
                "RestrictNamespaces": "yes", "LockPersonality": "yes", "ProtectKernelModules": "yes",
                "ProtectKernelTunables": "yes", "ProtectControlGroups": "yes", "UMask": "0077"}
    for key, value in required.items():
        assert d.get(key, [None])[-1] == value, f"{unit.name}: {key}"
    assert d["SystemCallFilter"][0] == "@system-service"


def test_agent_unit_lets_nvml_reach_the_gpus() -> None:
    """The agent keeps /dev/nvidia* (device ACL, no PrivateDevices) and /proc/driver (no ProcSubset)."""
    d = _unit_directives(DEPLOY / "systemd" / "gputrace-agent.service")
    assert d["DevicePolicy"] == ["closed"]
    assert "char-nvidia* rw" in d["DeviceAllow"]
    assert d.get("PrivateDevices", ["no"]) == ["no"] and "ProcSubset" not in d
    assert "video" in d["SupplementaryGroups"]
    collector = _unit_directives(DEPLOY / "systemd" / "gputrace-collector.service")
    assert collector["PrivateDevices"] == ["yes"] and collector["StateDirectory"] == ["gputrace"]


def test_compose_file_passes_compose_spec_schema(tmp_path: Path) -> None:
    """check-jsonschema's vendored Compose Specification schema accepts the file and rejects a typo."""
    cmd = [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec"]
    ok = subprocess.run([*cmd, str(COMPOSE)], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = tmp_path / "docker-compose.yml"
    bad.write_text(COMPOSE.read_text().replace("network_mode:", "networkmode:"))
    rejected = subprocess.run([*cmd, str(bad)], capture_output=True, text=True, timeout=120)
    assert rejected.returncode == 1 and "networkmode" in rejected.stdout


def test_compose_wires_prometheus_grafana_and_the_agent() -> None:
    """Bind-mount sources exist; Prometheus gets deploy/prometheus.yml; the agent defaults to sim."""
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert set(services) == {"agent", "prometheus", "grafana"}
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (COMPOSE.parent / source).exists(), f"{name}: {source}"
    prom_mounts = dict(v.split(":")[:2] for v in services["prometheus"]["volumes"])
    assert prom_mounts["./prometheus.yml"] == "/etc/prometheus/prometheus.yml"
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]
    assert (COMPOSE.parent / services["agent"]["build"]["context"] / services["agent"]["build"]["dockerfile"]
            ).exists()
    assert "${GPUTRACE_AGENT_BACKEND:-sim}" in services["agent"]["command"]


@pytest.mark.system
def test_prometheus_config_passes_promtool() -> None:
    """promtool accepts deploy/prometheus.yml, whose jobs scrape the agent's and collector's ports."""
    promtool = require_binary("promtool")
    result = subprocess.run([promtool, "check", "config", str(PROMETHEUS_YML)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    targets = {job["job_name"]: job["static_configs"][0]["targets"] for job in config["scrape_configs"]}
    assert targets == {"gputrace-agent": [f"127.0.0.1:{AGENT_PORT}"],
                       "gputrace-collector": [f"127.0.0.1:{COLLECTOR_PORT}"]}


def _k8s_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _servicemonitor_problems(doc: dict[str, Any]) -> list[str]:
    """Validate against prometheus-operator's CRD (cloudcoil's generated models); the models ignore
    unknown keys, so a key lost in the round trip is reported as unknown."""
    try:
        model = ServiceMonitor.model_validate(doc)
    except ValueError as exc:  # pydantic.ValidationError
        return [str(exc)]
    dumped = model.model_dump(by_alias=True, exclude_unset=True, mode="json")
    return [] if dumped == doc else [f"unknown or altered keys: {dumped} != {doc}"]


def test_kubernetes_manifests_pass_schemas() -> None:
    """Core objects pass the Kubernetes API schema (strict); the ServiceMonitor passes the operator's CRD."""
    docs = _k8s_docs(DAEMONSET)
    assert {d["kind"] for d in docs} == {"Namespace", "DaemonSet", "Service"}
    version = kubernetes_validate.latest_version()
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)
    (monitor,) = _k8s_docs(SERVICEMONITOR)
    assert _servicemonitor_problems(monitor) == []


def test_kubernetes_schema_checks_reject_mistakes() -> None:
    """A misspelt DaemonSet field and a misspelt or invalid ServiceMonitor field are all caught."""
    daemonset = next(d for d in _k8s_docs(DAEMONSET) if d["kind"] == "DaemonSet")
    bad = copy.deepcopy(daemonset)
    bad["spec"]["template"]["spec"]["hostNetwrk"] = False
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, kubernetes_validate.latest_version(), strict=True)
    (monitor,) = _k8s_docs(SERVICEMONITOR)
    typo = copy.deepcopy(monitor)
    typo["spec"]["endpoints"][0]["prot"] = "metrics"
    invalid = copy.deepcopy(monitor)
    invalid["spec"]["endpoints"][0]["interval"] = "5 seconds"
    assert _servicemonitor_problems(typo) and _servicemonitor_problems(invalid)


def test_kubernetes_objects_fit_together() -> None:
    """ServiceMonitor -> Service -> DaemonSet pods by labels and port name; the token Secret is shared."""
    docs = {d["kind"]: d for d in _k8s_docs(DAEMONSET)}
    (monitor,) = _k8s_docs(SERVICEMONITOR)
    service, daemonset = docs["Service"], docs["DaemonSet"]
    pod = daemonset["spec"]["template"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert monitor["metadata"]["namespace"] in monitor["spec"]["namespaceSelector"]["matchNames"]
    (container,) = pod["spec"]["containers"]
    port_names = {p["name"] for p in container["ports"]}
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names
    secret_volume = next(v for v in pod["spec"]["volumes"] if "secret" in v)
    assert secret_volume["secret"]["secretName"] == monitor["spec"]["endpoints"][0]["authorization"][
        "credentials"]["name"]
    assert pod["spec"]["hostNetwork"] is False and pod["spec"]["runtimeClassName"] == "nvidia"
    assert "nvidia.com/gpu" not in str(container["resources"])  # must not take GPUs from the engine
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] and not security["allowPrivilegeEscalation"]
    assert security["capabilities"]["drop"] == ["ALL"] and pod["spec"]["securityContext"]["runAsNonRoot"]


def _command_lines() -> dict[str, list[str]]:
    """Every gputrace command line in deploy/, as argv lists without the program name."""
    lines: dict[str, list[str]] = {}
    for unit in UNITS:
        for i, raw in enumerate(re.findall(r"^#?ExecStart=(.*)$", unit.read_text(), re.M)):
            argv = shlex.split(raw)
            if argv[0] == "/bin/sh":  # sh -c 'exec gputrace ...'
                argv = shlex.split(argv[2].replace("exec ", "", 1))
            assert argv[0] == INSTALLED_BINARY
            lines[f"{unit.name}#{i}"] = [a.replace("%%", "%") for a in argv[1:]]
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    lines["docker-compose agent"] = [re.sub(r"\$\{\w+:-([^}]+)\}", r"\1", a)
                                     for a in services["agent"]["command"]]
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    cmd = re.search(r"^CMD (\[.*\])$", dockerfile, re.M)
    assert cmd and re.search(r'^ENTRYPOINT \["gputrace"\]$', dockerfile, re.M)
    lines["Dockerfile CMD"] = yaml.safe_load(cmd.group(1))
    daemonset = next(d for d in _k8s_docs(DAEMONSET) if d["kind"] == "DaemonSet")
    lines["DaemonSet"] = daemonset["spec"]["template"]["spec"]["containers"][0]["args"]
    return lines


def _options(argv: list[str]) -> tuple[str, dict[str, str | None]]:
    command, rest = argv[0], argv[1:]
    spec = CLI_SPEC[command]
    options: dict[str, str | None] = {}
    while rest:
        flag = rest.pop(0)
        assert flag in spec, f"gputrace {command}: unknown option {flag}"
        options[flag] = rest.pop(0) if spec[flag] else None
    return command, options


def test_command_lines_use_the_specified_cli() -> None:
    """Every deploy command line uses only the agent/collect options of issues 4 and 6, safely."""
    lines = _command_lines()
    assert len(lines) >= 6
    for where, argv in lines.items():
        command, options = _options(argv)
        listen = options.get("--listen") or ""
        host = listen.rsplit(":", 1)[0]
        if command == "agent":
            assert options.get("--backend") in {"nvml", "sim"}, where
            assert listen.endswith(f":{AGENT_PORT}"), where
            # The agent refuses a non-loopback address without a token; so do these files.
            assert host == "127.0.0.1" or "--token-file" in options, where
        else:
            assert listen == f"127.0.0.1:{COLLECTOR_PORT}" and options["--config"] and options["--out"], where


def test_command_lines_parse_with_the_real_cli() -> None:
    """Where `gputrace agent` / `gputrace collect` exist, their click commands know every option used."""
    checked = 0
    for argv in _command_lines().values():
        name = argv[0]
        if importlib.util.find_spec(f"gputrace.commands.{name}") is None:
            continue
        command: click.Command = importlib.import_module(f"gputrace.commands.{name}").command
        known = {opt for param in command.params for opt in param.opts + param.secondary_opts}
        _, options = _options(argv)
        assert set(options) <= known, f"gputrace {name} lacks {set(options) - known}"
        checked += 1
    if not checked:
        pytest.skip("neither gputrace agent nor gputrace collect is built yet")


def test_dockerfile_installs_this_package() -> None:
    """The image installs the checkout and runs as the non-root uid the DaemonSet expects."""
    text = (DEPLOY / "Dockerfile").read_text()
    assert "COPY pyproject.toml" in text and "COPY gputrace ./gputrace" in text
    user = re.search(r"^USER (\d+)$", text, re.M)
    daemonset = next(d for d in _k8s_docs(DAEMONSET) if d["kind"] == "DaemonSet")
    pod_security = daemonset["spec"]["template"]["spec"]["securityContext"]
    assert user and int(user.group(1)) == pod_security["runAsUser"]
