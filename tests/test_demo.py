"""`gputrace demo --quick`: the whole chain as real processes, three runs of the motivating
deployment (defaults, gputrace's own top recommendation applied, K = 64), their reports and the
comparisons ([diagnosis] Must show 4)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gputrace.demo import FIRST_TRY, FLAG_PARAMS


def _phases(doc: dict) -> dict[str, float]:  # type: ignore[type-arg]
    return {p["label"]: p["throughput_tok_s"] for p in doc["phases"]}


def _top_change(doc: dict) -> dict:  # type: ignore[type-arg]
    """The first finding of findings.json (ranked) that names an engine flag with a value."""
    return next(f for f in doc["findings"]
                if (f.get("change") or {}).get("knob") in FLAG_PARAMS and f["change"]["value"])


@pytest.mark.slow
def test_quick_demo_applies_its_own_recommendation(tmp_path: Path) -> None:
    """The defaults' findings name a change with a value; the second run applies exactly that (as
    its log's configuration says) and is faster at the phase the finding named; the K = 64 run
    runs with K 64; the table and the recommendation's measured effect are printed."""
    out = tmp_path / "demo"
    done = subprocess.run([sys.executable, "-m", "gputrace", "demo", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    docs = {run: json.loads((out / run / "report" / "findings.json").read_text())
            for run in ("defaults", "recommended", "k64")}
    rec = _top_change(docs["defaults"])
    assert rec["change"]["knob"] == "--pp-max-micro-batch-size"
    assert rec["cause"] == "pipeline_underfilled"  # the default K bunches the load below 64
    assert 1 <= rec["change"]["value"] < 8
    # the recommended run's engine logged the recommended setting, the first try K = 64
    assert docs["recommended"]["summary"]["engine"]["pp_max_micro_batch_size"] == rec["change"]["value"]
    assert docs["k64"]["summary"]["engine"]["pp_max_micro_batch_size"] == FIRST_TRY["pp_max_micro_batch_size"]
    phase = rec["phase"]
    before, after = _phases(docs["defaults"])[phase], _phases(docs["recommended"])[phase]
    assert after > before, (rec, before, after)
    gain = after / before - 1
    assert f"at {phase} ({gain:+.0%})" in done.stdout.replace("\n", " ")
    assert "vs defaults" in done.stdout
    # [whatif]: the prediction made from the defaults' run, printed beside the measured gain
    assert rec.get("predicted") is not None and "predicted before the rerun" in done.stdout
    for run in docs:
        assert (out / run / "report" / "report.html").stat().st_size > 10_000
    assert any((out / "compare-defaults-recommended").iterdir())
    assert any((out / "compare-defaults-k64").iterdir())
