"""The CLI's contract: version, help, one-line errors and exit statuses."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers import cli, gputrace_process

from gputrace import __version__


def test_version() -> None:
    """--version prints the package version."""
    out = gputrace_process("--version")
    assert out.returncode == 0
    assert __version__ in out.stdout


def test_help_lists_only_built_commands() -> None:
    """--help lists every registered command and each one's --help works."""
    from gputrace.cli import COMMAND_MODULES, _command_name

    out = gputrace_process("--help")
    assert out.returncode == 0
    for name in COMMAND_MODULES:
        assert _command_name(name) in out.stdout
        sub = cli([_command_name(name), "--help"])
        assert sub.exit_code == 0, sub.output
        assert "Usage:" in sub.output


def test_unknown_command_is_usage_error() -> None:
    """An unknown command is one line on stderr and exit status 2."""
    out = gputrace_process("no-such-command")
    assert out.returncode == 2
    assert out.stderr.startswith("gputrace: error: ")
    assert len(out.stderr.strip().splitlines()) == 1


def test_bare_gputrace_prints_its_help_as_help() -> None:
    """`gputrace` alone prints the help on stdout and exits 0 (it printed it as an error)."""
    out = gputrace_process()
    assert out.returncode == 0 and out.stdout.startswith("Usage: gputrace") and "error" not in out.stderr


def test_debug_works_anywhere_before_a_wrapped_command() -> None:
    """`--debug` after the subcommand gives the traceback and the one-line error, not 'no such option'."""
    out = gputrace_process("check-config", "/nonexistent.toml", "--debug")
    assert out.returncode == 2
    assert "Traceback" in out.stderr and out.stderr.strip().endswith("/nonexistent.toml: no such file")
    assert "No such option" not in out.stderr


def test_nothing_recognised_is_said_and_fails(tmp_path: Path) -> None:
    """`parse` and `import` of a file with no engine line say so and exit 1 (they exited 0, the
    import with an empty run)."""
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\x00\xff binary \x89PNG\n" * 50)
    parsed = gputrace_process("parse", str(junk))
    assert parsed.returncode == 1
    assert "no engine scheduler, stats or configuration line recognised" in parsed.stderr
    imported = gputrace_process("import", "--run", str(tmp_path / "run"), "--sglang-log", str(junk))
    assert imported.returncode == 1 and "no sglang line recognised in its 50 lines" in imported.stderr
    assert not (tmp_path / "run").exists()


def test_help_lists_every_command_without_importing_them() -> None:
    """`gputrace --help` takes each command's line from gputrace.commands.SUMMARIES and imports no
    command module (listing them imported DuckDB, matplotlib and asyncssh: 1.6 s, 155 MB)."""
    import gputrace.commands as commands_pkg
    from gputrace.cli import COMMAND_MODULES, _command_name

    assert set(commands_pkg.SUMMARIES) == {_command_name(m) for m in COMMAND_MODULES}
    probe = ("import sys; from gputrace.cli import main\n"
             "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
             "heavy = [m for m in ('duckdb', 'matplotlib', 'asyncssh', 'aiohttp', 'gputrace.commands.run_') "
             "if m in sys.modules]\nprint('HEAVY', heavy)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert "HEAVY []" in out.stdout, out.stdout[-500:]
    for name, line in commands_pkg.SUMMARIES.items():
        assert f"{name}  " in out.stdout and line in out.stdout


def test_watch_without_a_terminal_says_it_needs_one() -> None:
    """`watch` with its output in a pipe exits 2 with one line naming /v1/status (it printed
    nothing and ran until killed)."""
    out = gputrace_process("watch", "--collector", "http://127.0.0.1:9")
    assert out.returncode == 2
    assert out.stderr.strip() == ("gputrace: error: watch draws a live view and needs a terminal; without "
                                  "one, read http://127.0.0.1:9/v1/status (JSON) or the collector's /metrics")


def test_debug_works_before_and_between_the_subcommands_options() -> None:
    """`--debug` before the subcommand or among its arguments: the traceback, then the one-line
    error (the issue: 'works anywhere on the line')."""
    for argv in (("--debug", "check-config", "/nonexistent.toml"),
                 ("check-config", "--debug", "/nonexistent.toml")):
        out = gputrace_process(*argv)
        assert out.returncode == 2, argv
        assert "Traceback" in out.stderr and out.stderr.strip().endswith("/nonexistent.toml: no such file")
        assert "No such option" not in out.stderr


def test_debug_after_a_wrapped_commands_separator_is_that_commands() -> None:
    """`gputrace run ... -- prog --debug`: the --debug is prog's, so gputrace shows no traceback."""
    out = gputrace_process("run", "--config", "/nonexistent.toml", "--out", "/nonexistent-out", "--",
                  "prog", "--debug")
    assert out.returncode == 2
    assert out.stderr == "gputrace: error: /nonexistent.toml: no such file\n"


def test_run_warmup_help_says_it_warms_up_once() -> None:
    """`run --help`: the warm-up runs once before the sweep (it said 'before each level'; the
    load generator warms up once)."""
    out = gputrace_process("run", "--help")
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    assert "seconds of warm-up at the first level's concurrency, once, before the sweep" in text
    assert "each level" not in text[text.index("--warmup"):text.index("--stream")]


def test_mark_help_is_not_cut_at_its_example() -> None:
    """`mark`'s line in `gputrace --help` and its own help keep the example (click cut the listing
    at '(e.g.')."""
    listing = gputrace_process("--help").stdout
    (line,) = [ln for ln in listing.splitlines() if ln.strip().startswith("mark ")]
    assert line.rstrip().endswith("Mark a load phase in the running capture (C=64).")
    own = " ".join(gputrace_process("mark", "--help").stdout.split())
    assert "Mark the start of a load phase (e.g. `gputrace mark C=64`) in the running capture." in own


def test_demo_quick_is_the_same_in_help_and_reference() -> None:
    """`demo --help` and the reference (docs/capture.md) give `--quick` the same runs (they once
    said 45 s where it took 50): the first try's C=32 K=64 level with 4,096-token bursts only."""
    import re

    helped = " ".join(gputrace_process("demo", "--help").stdout.split())
    reference = " ".join((Path(__file__).resolve().parents[1] / "docs" / "capture.md").read_text().split())
    said_help = re.search(r"--quick Of the first try's figures, C=(\d+) K=64 alone \(([\d,]+) tokens\)",
                          helped)
    assert said_help, helped
    section = reference[reference.index("## `gputrace demo"):]
    said_reference = re.search(r"`--quick`: C = (\d+) with ([\d,]+) only", section)
    assert said_reference, section[:2000]
    assert said_help.groups() == said_reference.groups() == ("32", "4,096")
