"""The log setup: where lines go when the process's stderr is swapped."""

from __future__ import annotations

import contextlib
import io

import pytest

from gputrace.logsetup import configure_logging, get_logger


def test_a_log_line_goes_to_stderr_as_it_is_when_written(capsys: pytest.CaptureFixture[str]) -> None:
    """Configured while an in-process caller had swapped stderr (click's test runner, a notebook
    cell) and closed it after: a later warning goes to the stderr of the moment, not to the closed
    stream (it raised 'I/O operation on closed file' inside an import, which lost the import)."""
    swapped = io.StringIO()
    with contextlib.redirect_stderr(swapped):
        configure_logging("console")
    swapped.close()
    get_logger("import").warning("bad rows skipped", bad=1)
    assert "bad rows skipped" in capsys.readouterr().err
