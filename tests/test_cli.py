"""The CLI's contract: version, help, one-line errors and exit statuses."""

from __future__ import annotations

import subprocess
import sys

from gputrace import __version__


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gputrace", *args], capture_output=True, text=True, timeout=60
    )


def test_version() -> None:
    """--version prints the package version."""
    out = run_cli("--version")
    assert out.returncode == 0
    assert __version__ in out.stdout


def test_help_lists_only_built_commands() -> None:
    """--help lists every registered command and each one's --help works."""
    from click.testing import CliRunner

    from gputrace.cli import COMMAND_MODULES, _command_name, cli

    out = run_cli("--help")
    assert out.returncode == 0
    runner = CliRunner()
    for name in COMMAND_MODULES:
        assert _command_name(name) in out.stdout
        sub = runner.invoke(cli, [_command_name(name), "--help"])
        assert sub.exit_code == 0, sub.output
        assert "Usage:" in sub.output


def test_unknown_command_is_usage_error() -> None:
    """An unknown command is one line on stderr and exit status 2."""
    out = run_cli("no-such-command")
    assert out.returncode == 2
    assert out.stderr.startswith("gputrace: error: ")
    assert len(out.stderr.strip().splitlines()) == 1
