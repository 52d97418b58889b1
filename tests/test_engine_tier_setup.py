"""The engine tier's setup: without its prerequisites it stops before starting an engine, within
seconds, and says in one line what is missing (a skip, or a failure under
GPUTRACE_REQUIRE_ENGINE_TESTS=1)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import pytest

REPO = Path(__file__).resolve().parents[1]


def _engine_tier(tmp_path: Path, require: bool) -> tuple[subprocess.CompletedProcess[str], float]:
    """The engine tier's first test run with a PATH that has no prometheus (only this Python's
    directory) and an engines' venv that is not there; with the seconds pytest timed for that
    test (its setup, where the engines would start: the interpreter's start and the imports
    before it are not the tier's, and took over 10 s themselves on a machine at load 19)."""
    env = {**os.environ, "PATH": str(Path(sys.executable).parent),
           "GPUTRACE_ENGINES_VENV": str(tmp_path / "no-venv-engines")}
    env.pop("GPUTRACE_REQUIRE_ENGINE_TESTS", None)
    if require:
        env["GPUTRACE_REQUIRE_ENGINE_TESTS"] = "1"
    junit = tmp_path / "junit.xml"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rsE", "-p", "no:cacheprovider", "-x", f"--junitxml={junit}",
         "tests/test_engines_real.py::test_sglang_requests_wait_at_the_pool_limit"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    case = ElementTree.parse(junit).getroot().find(".//testcase")
    assert case is not None, done.stdout[-3000:]
    return done, float(case.get("time", "inf"))


@pytest.mark.parametrize("require", [False, True], ids=["skip", "required"])
def test_engine_tier_without_prerequisites_stops_before_any_engine(tmp_path: Path, require: bool) -> None:
    """No Prometheus and no engines' venv: one line naming both, within 10 s, no engine started."""
    done, elapsed_s = _engine_tier(tmp_path, require)
    out = done.stdout + done.stderr
    reason = next((line for line in out.splitlines() if "the engine tier needs:" in line), None)
    assert reason is not None, out[-3000:]
    assert "prometheus" in reason and "no-venv-engines is absent" in reason, reason
    assert elapsed_s < 10, f"the tier's setup took {elapsed_s:.1f} s"  # an engine alone takes a minute
    if require:
        assert done.returncode != 0 and "GPUTRACE_REQUIRE_ENGINE_TESTS=1" in out, out[-3000:]
    else:
        assert done.returncode == 0 and "1 skipped" in out, out[-3000:]
