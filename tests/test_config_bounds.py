"""check-config and collect refuse what cannot describe a deployment ([robust] #25 items 9 and 10):
sizes past any deployment, a bad timezone, impossible [[topology.map]] rows, NaN or negative
[load] values, TOML nested past reason; an IPv6 SSH target in brackets is read and used."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from helpers import gputrace_process
from sshd import SSHD_CANDIDATES, running_sshd

from gputrace.config import load_config
from gputrace.remote.connect import connect_host

HOST = """
[[hosts]]
name = "node0"
gpus = [0, 1]

[hosts.log]
kind = "file"
path = "/tmp/does-not-matter.log"
"""


def _check(tmp_path: Path, text: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "gputrace.toml"
    path.write_text(text)
    return gputrace_process("check-config", str(path))


def _one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("gputrace: error: ") and "unexpected" not in line
    return line


@pytest.mark.parametrize(("topology", "key"), [
    ("pp_size = 1000000000", "topology.pp_size: must be <= 1024"),
    ("tp_size = 4096", "topology.tp_size: must be <= 1024"),
    ("dp_size = 1025", "topology.dp_size: must be <= 1024"),
    ("nnodes = 100000", "topology.nnodes: must be <= 1024"),
    ("pp_size = 1024\ntp_size = 1024", "pp_size x tp_size x dp_size = 1048576 GPUs"),
])
def test_sizes_past_any_deployment_are_refused(tmp_path: Path, topology: str, key: str) -> None:
    """A pp_size of 10^9 (it grew collect to 2.8 GB building placements) and other sizes past
    1024, or a product past 65,536 GPUs, are one error line at check-config, exit 2."""
    assert key in _one_error_line(_check(tmp_path, HOST + f"\n[topology]\n{topology}\n"))


def test_collect_refuses_a_huge_pp_size_at_once(tmp_path: Path) -> None:
    """collect reads the same config: one error line, exit 2, and no run left. (It took 1.2 s on a
    quiet core; a shared CI core once stretched check-config alone to 25 s, so the limit only
    stops a collect that builds placements for 10^9 stages, which grew it to 2.8 GB.)"""
    path = tmp_path / "gputrace.toml"
    path.write_text(HOST + "\n[topology]\npp_size = 1000000000\n")
    proc = gputrace_process("collect", "--config", str(path), "--out", str(tmp_path / "run"), "--listen", "",
                            timeout_s=120)
    assert "topology.pp_size: must be <= 1024" in _one_error_line(proc)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("text", "key"), [
    (HOST.replace('path = "/tmp', 'timezone = "Mars/Olympus_Mons"\npath = "/tmp'),
     "hosts[0].log.timezone: unknown timezone 'Mars/Olympus_Mons'"),
    (HOST.replace('path = "/tmp', 'timezone = "America"\npath = "/tmp'),
     "hosts[0].log.timezone: unknown timezone 'America'"),
    (HOST + '\n[topology]\npp_size = 2\n[[topology.map]]\nhost = "node0"\ngpu = 0\npp_rank = -1\n',
     "topology.map[0].pp_rank: must be from 0 to 1"),
    (HOST + '\n[topology]\npp_size = 2\n[[topology.map]]\nhost = "node0"\ngpu = 0\npp_rank = 2\n',
     "topology.map[0].pp_rank: must be from 0 to 1"),
    (HOST + '\n[topology]\npp_size = 2\n[[topology.map]]\nhost = "node0"\ngpu = 1\npp_rank = 0\n'
     '[[topology.map]]\nhost = "node0"\ngpu = 1\npp_rank = 1\n',
     "topology.map[1].gpu: GPU 1 of host 'node0' is mapped twice (also in topology.map[0])"),
    (HOST + '\n[load]\nurl = "http://127.0.0.1:1"\ntemperature = nan\n',
     "load.temperature: must be a finite"),
    (HOST + '\n[load]\nurl = "http://127.0.0.1:1"\ntemperature = -0.5\n',
     "load.temperature: must be a finite"),
    (HOST + '\n[load]\nurl = "http://127.0.0.1:1"\nduration_per_level_s = inf\n',
     "load.duration_per_level_s: must be a finite number > 0"),
    (HOST + '\n[load]\nurl = "http://127.0.0.1:1"\nduration_per_level_s = -3.0\n',
     "load.duration_per_level_s: must be a finite number > 0"),
    (HOST + '\n[load]\nurl = "http://127.0.0.1:1"\nrequests_per_level = -4\n',
     "load.requests_per_level: must be >= 1"),
    (HOST.replace('gpus = [0, 1]', 'gpus = [0, 1]\nnode_rank = 3'), "hosts[0].node_rank: must be below"),
    (HOST.replace("gpus = [0, 1]", "gpus = [0, 1, 0]"),
     "hosts[0].gpus[2]: GPU 0 is listed twice (also at gpus[0])"),
    (HOST.replace('name = "node0"', 'name = ""'), "hosts[0].name: must not be empty"),
    (HOST.replace('name = "node0"', 'name = "  "'), "hosts[0].name: must not be empty"),
    (HOST + '\n[load]\nurl = "http://127.0.0.1:1"\nconcurrency = [1, 100000000000]\n',
     "load.concurrency[1]: 100000000000 requests in flight need as many open connections; this "
     "machine can hold at most"),
    ("x = " + "[" * 100_000 + "]" * 100_000 + "\n", "nested too deeply"),
    ("x = " + "{a = " * 50_000 + "1" + "}" * 50_000 + "\n", "nested too deeply"),
])
def test_check_config_catches_what_would_fail_later(tmp_path: Path, text: str, key: str) -> None:
    """Each is one error line naming the key, exit 2 (a bad timezone used to pass and the capture
    then ran without its engine log; deep TOML was 'unexpected RecursionError', exit 1)."""
    assert key in _one_error_line(_check(tmp_path, text))


@pytest.mark.parametrize(("option", "path"), [
    ("--sglang-log", Path(__file__).parent / "data/engines/sglang-0.5.23-pp2/default/engine.log"),
    ("--nvidia-smi-csv", Path(__file__).parent / "import_data" / "nvidia_smi_query.csv"),
])
@pytest.mark.parametrize("zone", ["America", "Mars/Base", "+99:00", "a" * 5000])
def test_import_refuses_a_bad_timezone_in_one_line(tmp_path: Path, option: str, path: Path,
                                                     zone: str) -> None:
    """`import --timezone` with a directory of the zone database, an unknown name, an offset of
    days or a name too long for a file: one error line, exit 2, no run left behind."""
    proc = gputrace_process("import", "--run", str(tmp_path / "run"), "--timezone", zone, option, str(path))
    assert "unknown time" in _one_error_line(proc) or "expected UTC" in _one_error_line(proc)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("ssh", "host", "port"), [
    ("root@[::1]:2222", "::1", 2222),
    ("[fe80::1]", "fe80::1", 22),
    ("root@::1", "::1", 22),
    ("ubuntu@10.0.0.5:2200", "10.0.0.5", 2200),
])
def test_ssh_targets_read_ipv6_in_brackets(tmp_path: Path, ssh: str, host: str, port: int) -> None:
    """``root@[::1]:22`` is host ::1 port 22 (it was read as host ``[::1]:22``); check-config
    shows it in brackets again."""
    path = tmp_path / "gputrace.toml"
    path.write_text(HOST.replace('gpus = [0, 1]', f'gpus = [0, 1]\nssh = "{ssh}"'))
    (target,) = [h.ssh for h in load_config(path).hosts]
    assert target is not None and (target.host, target.port) == (host, port)
    proc = gputrace_process("check-config", str(path))
    assert proc.returncode == 0, proc.stderr
    shown = f"[{host}]" if ":" in host else host
    assert f"ssh {(ssh.split('@')[0] + '@') if '@' in ssh else ''}{shown}:{port};" in proc.stdout


@pytest.mark.parametrize("ssh", ["root@[::1", "root@[::1]x", "root@[::1]:99999", "root@a:b:c"])
def test_malformed_ipv6_targets_are_one_line(tmp_path: Path, ssh: str) -> None:
    """A bracket left open, text after it, a port past 65535 or colons in a name: one error line."""
    assert "hosts[0].ssh" in _one_error_line(
        _check(tmp_path, HOST.replace('gpus = [0, 1]', f'gpus = [0, 1]\nssh = "{ssh}"')))


async def test_an_ipv6_target_reaches_a_real_sshd_on_ipv6_loopback(tmp_path: Path) -> None:
    """``root@[::1]:PORT`` from gputrace.toml connects to an sshd listening only on ::1 and runs
    a command there."""
    from conftest import require_binary

    sshd = require_binary(*SSHD_CANDIDATES)
    with running_sshd(tmp_path / "sshd", sshd, address="::1") as server:
        path = tmp_path / "gputrace.toml"
        path.write_text(
            f'[[hosts]]\nname = "v6"\nssh = "root@[::1]:{server.port}"\n'
            f'identity_file = "{server.client_key_path}"\nknown_hosts = "{server.known_hosts_path}"\n')
        (host,) = load_config(path).hosts
        transport = await connect_host(host)
        try:
            assert (await transport.run(["echo", "over ipv6"])).stdout == b"over ipv6\n"
        finally:
            await transport.close()
