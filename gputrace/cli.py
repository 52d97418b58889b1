"""The ``gputrace`` command line: a click group whose commands live in gputrace/commands/.

Errors: a GputraceError prints ``gputrace: error: ...`` on one line and exits with its
``exit_code`` (2 for usage and configuration, 1 for runtime failures); ``--debug`` (or
GPUTRACE_DEBUG=1) shows the traceback instead.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys
import traceback

import click

import gputrace.commands as commands_pkg
from gputrace import __version__
from gputrace.errors import GputraceError
from gputrace.logsetup import configure_logging


def _command_modules() -> list[str]:
    """Every module in gputrace/commands/ is a command (``import_`` -> ``import``)."""
    return sorted(m.name for m in pkgutil.iter_modules(commands_pkg.__path__) if not m.ispkg)


def _command_name(module_name: str) -> str:
    return module_name.rstrip("_").replace("_", "-")


COMMAND_MODULES = _command_modules()


class _LazyGroup(click.Group):
    """Imports a command's module only when that command runs; the listing in --help comes from
    gputrace.commands.SUMMARIES, so it imports none (keeps startup fast)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [_command_name(m) for m in COMMAND_MODULES]

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, commands_pkg.SUMMARIES.get(name, "")) for name in self.list_commands(ctx)]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        by_name = {_command_name(m): m for m in COMMAND_MODULES}
        module_name = by_name.get(cmd_name)
        if module_name is None:
            return None
        module = importlib.import_module(f"gputrace.commands.{module_name}")
        command: click.Command = module.command
        return command


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="gputrace")
@click.option("--debug", is_flag=True, help="Show tracebacks and debug logs.")
@click.option(
    "--log-format",
    type=click.Choice(["console", "json"]),
    default="console",
    show_default=True,
    help="Log line format on stderr.",
)
def cli(debug: bool, log_format: str) -> None:
    """gputrace: see why a pipeline-parallel LLM deployment idles.

    Samples every GPU through NVML, follows the serving engine's scheduler log, knows the
    request load, aligns them in time per pipeline stage, and diagnoses bubbles.
    """
    configure_logging(log_format, "debug" if debug else "info")


def _own_args(argv: list[str]) -> list[str]:
    """The arguments before a ``--`` (what follows is a wrapped command's)."""
    return argv[:argv.index("--")] if "--" in argv else argv


def _debug_requested(argv: list[str]) -> bool:
    return "--debug" in _own_args(argv) or os.environ.get("GPUTRACE_DEBUG") == "1"


def _with_debug_first(argv: list[str]) -> list[str]:
    """``--debug`` anywhere before ``--`` moved to the front, where the group takes it (after a
    subcommand click rejected it, once the traceback had been shown)."""
    own = _own_args(argv)
    if "--debug" not in own:
        return argv
    return ["--debug", *[a for a in own if a != "--debug"], *argv[len(own):]]


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point; maps every failure to one line and an exit status."""
    args = sys.argv[1:] if argv is None else argv
    debug = _debug_requested(args)
    # bare `gputrace` shows its help as help, not as an error
    args = _with_debug_first(args) if args else ["--help"]
    configure_logging("console", "info")
    try:
        cli.main(args=args, prog_name="gputrace", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("gputrace: interrupted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        if debug:
            traceback.print_exc()
        click.echo(f"gputrace: error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except GputraceError as exc:
        if debug:
            traceback.print_exc()
        click.echo(f"gputrace: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        click.echo("gputrace: interrupted", err=True)
        sys.exit(130)
    except Exception as exc:
        if debug:
            traceback.print_exc()
        else:
            click.echo(
                f"gputrace: error: unexpected {type(exc).__name__}: {exc} "
                "(run with --debug for the traceback)",
                err=True,
            )
        sys.exit(1)
