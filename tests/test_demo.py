"""`gputrace demo --quick`: the whole chain as real processes; the default cap is diagnosed, the fix
is not, and both reports and the comparison are written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_quick_demo_diagnoses_the_cap_and_not_the_fix(tmp_path: Path) -> None:
    """The cap run's findings include microbatch_cap (K = 64 // 8); the fixed run's do not."""
    out = tmp_path / "demo"
    done = subprocess.run([sys.executable, "-m", "gputrace", "demo", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    cap = json.loads((out / "cap" / "report" / "findings.json").read_text())
    fixed = json.loads((out / "fixed" / "report" / "findings.json").read_text())
    cap_causes = {f["cause"] for f in cap["findings"]}
    assert "microbatch_cap" in cap_causes
    first_cap = next(f for f in cap["findings"] if f["cause"] == "microbatch_cap")
    assert first_cap["evidence"]["K"] == 8
    assert "--pp-max-micro-batch-size" in first_cap["recommendation"]
    assert "microbatch_cap" not in {f["cause"] for f in fixed["findings"]}
    for run in ("cap", "fixed"):
        assert (out / run / "report" / "report.html").stat().st_size > 10_000
    assert any((out / "compare").iterdir())
    assert "microbatch_cap" in done.stdout
