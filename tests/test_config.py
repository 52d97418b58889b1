"""gputrace.toml validation: every error is one line naming the file and the key."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gputrace.config import load_config
from gputrace.errors import ConfigError
from gputrace.topology import Placement

GOOD = """
[run]
name = "pp8"

[[hosts]]
name = "node0"
ssh = "ubuntu@10.0.0.5:2222"
agent = "127.0.0.1:9400"
gpus = [0, 1, 2, 3, 4, 5, 6, 7]

[hosts.log]
kind = "file"
path = "/var/log/sglang.log"

[topology]
pp_size = 8

[load]
url = "http://10.0.0.5:30000"
concurrency = [1, 8, 32, 64]
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "gputrace.toml"
    p.write_text(text)
    return p


def test_good_config_loads(tmp_path: Path) -> None:
    """A complete configuration loads into typed values."""
    cfg = load_config(write(tmp_path, GOOD))
    (host,) = cfg.hosts
    assert host.ssh is not None and (host.ssh.user, host.ssh.host, host.ssh.port) == (
        "ubuntu", "10.0.0.5", 2222)
    assert host.gpus == tuple(range(8))
    assert host.log is not None and host.log.target == "/var/log/sglang.log"
    assert cfg.topology.pp_size == 8
    assert cfg.load is not None and cfg.load.concurrency == (1, 8, 32, 64)


@pytest.mark.parametrize(
    ("text", "key", "what"),
    [
        (GOOD.replace("pp_size = 8", "pp_size = 8\npp_sise = 2"), "topology.pp_sise", "unknown key"),
        (GOOD.replace('agent = "127.0.0.1:9400"', "agent = 9400"), "hosts[0].agent", "expected a string"),
        (GOOD.replace('name = "node0"', ""), "hosts[0].name", "required key is missing"),
        (GOOD.replace("pp_size = 8", 'pp_size = "8"'), "topology.pp_size", "expected an integer"),
        (GOOD + '\n[[hosts]]\nname = "node0"\n', "hosts[1].name", "duplicate host name"),
        (GOOD.replace('kind = "file"', 'kind = "syslog"'), "hosts[0].log.kind", "must be one of"),
        (GOOD.replace("gpus = [0, 1", 'gpus = ["a", 1'), "hosts[0].gpus[0]", "expected an integer"),
        (GOOD.replace("concurrency = [1,", "concurrency = [0,"), "load.concurrency[0]", ">= 1"),
        (GOOD.replace('url = "http://10.0.0.5:30000"', 'url = "10.0.0.5"'), "load.url", "http://"),
        ("[run]\nname = 'x'\n", "hosts", "required key is missing"),
    ],
)
def test_bad_config_names_the_key(tmp_path: Path, text: str, key: str, what: str) -> None:
    """Unknown keys, wrong types, missing keys and duplicates name the key."""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: {key}: "), message
    assert what in message
    assert "\n" not in message


def test_not_toml(tmp_path: Path) -> None:
    """A file that is not TOML is named as such."""
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[hosts\nname = "))


def test_binary_file(tmp_path: Path) -> None:
    """A binary file is refused as not TOML, not with a decode traceback."""
    p = tmp_path / "gputrace.toml"
    p.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(p)


def test_missing_file(tmp_path: Path) -> None:
    """A missing file is named."""
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "absent.toml")


def test_unreadable_file(tmp_path: Path) -> None:
    """A file without read permission is named (as root, checked from an unprivileged child)."""
    p = write(tmp_path, GOOD)
    p.chmod(0)
    if os.geteuid() != 0:
        with pytest.raises(ConfigError, match="permission denied"):
            load_config(p)
        return
    # Root bypasses file modes; a child without CAP_DAC_OVERRIDE meets them like any user.
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root and util-linux's setpriv is missing: cannot drop CAP_DAC_OVERRIDE")
    code = ("import sys; from gputrace.config import load_config; from gputrace.errors import ConfigError\n"
            "try:\n    load_config(sys.argv[1])\nexcept ConfigError as e:\n    print(e)")
    out = subprocess.run(
        [setpriv, "--bounding-set=-dac_override,-dac_read_search", sys.executable, "-c", code, str(p)],
        capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == f"{p}: permission denied", out.stderr


def test_directory_instead_of_file(tmp_path: Path) -> None:
    """A directory given as the config is refused clearly."""
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)


def test_cli_prints_one_line_and_exits_2(tmp_path: Path) -> None:
    """The CLI shows a config error on one line with exit status 2, never a traceback."""
    path = write(tmp_path, GOOD.replace("pp_size = 8", "pp_size = true"))
    out = subprocess.run(
        [sys.executable, "-m", "gputrace", "check-config", str(path)],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 2
    expected = f"gputrace: error: {path}: topology.pp_size: expected an integer, got a boolean True"
    assert out.stderr.strip() == expected
    assert "Traceback" not in out.stderr


def test_the_readme_example_config_is_valid() -> None:
    """examples/gputrace.toml, which the README points new users to, passes check-config."""
    example = Path(__file__).resolve().parent.parent / "examples" / "gputrace.toml"
    done = subprocess.run([sys.executable, "-m", "gputrace", "check-config", str(example)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "host node0: ssh ubuntu@10.0.0.5:22" in done.stdout and "C=1,8,32,64" in done.stdout


def test_ignore_eos_reaches_the_load_spec(tmp_path: Path) -> None:
    """`ignore_eos` in [load] and `gputrace run --ignore-eos` both make the built-in load send it;
    the flag overrides the table either way."""
    from gputrace.commands.run_ import load_spec_from

    plain = load_config(write(tmp_path, GOOD))
    assert not load_spec_from(plain, None, None, None, None, None, None, None, None, None).ignore_eos
    assert load_spec_from(plain, None, None, None, None, None, None, None, None, None,
                          ignore_eos=True).ignore_eos
    table = load_config(write(tmp_path, GOOD + "ignore_eos = true\n"))
    assert load_spec_from(table, None, None, None, None, None, None, None, None, None).ignore_eos
    assert not load_spec_from(table, None, None, None, None, None, None, None, None, None,
                              ignore_eos=False).ignore_eos


def test_check_config_says_when_the_gpus_do_not_cover_the_topology(tmp_path: Path) -> None:
    """gpus = [0, 1, 2, 3] for PP8 x TP1: check-config says that four stages would have no GPU."""
    short = GOOD.replace("gpus = [0, 1, 2, 3, 4, 5, 6, 7]", "gpus = [0, 1, 2, 3]")
    out = subprocess.run([sys.executable, "-m", "gputrace", "check-config", str(write(tmp_path, short))],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert "warning: the hosts list 4 GPUs, but pp x tp x dp = 8 x 1 x 1 = 8" in out.stdout
    full = subprocess.run([sys.executable, "-m", "gputrace", "check-config", str(write(tmp_path, GOOD))],
                          capture_output=True, text=True, timeout=60)
    assert "warning" not in full.stdout


def test_placements_come_from_the_table_or_sglangs_rule(tmp_path: Path) -> None:
    """An explicit [[topology.map]] gives the placements as written; without one, SGLang's rule."""
    formula = load_config(write(tmp_path, GOOD)).placements()
    assert formula == [Placement("node0", g, g, 0) for g in range(8)]
    table = GOOD.replace("pp_size = 8", 'pp_size = 2\n\n[[topology.map]]\nhost = "node0"\ngpu = 3\n'
                         'pp_rank = 1\ntp_rank = 0\ndp_rank = 1')
    assert load_config(write(tmp_path, table)).placements() == [Placement("node0", 3, 1, 0, 1)]
