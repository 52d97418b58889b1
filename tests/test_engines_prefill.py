"""Engine tier, [prefill] (issue 47, Must-show 1): the real SGLang 0.5.23 (PP2 on this machine's
CPU, the tier's tiny model) serving prompts of 950-1,900 tokens in 256-token chunks at a closed
loop of 8. One chunked request at a time holds the others in the queue (issue 47 measured 1.85
waiting, 4 of 16 running, and x2.06 from a chunk of 4096); gputrace's report of that run, captured
as a user captures it (`gputrace run` with the log and the engine's /metrics), names the prefill
budget with SGLang's own `--chunked-prefill-size`. The gain itself is measured in
`bench/whatif_engines.py --pairs chunk`, not asserted here. About 2 minutes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from engine_servers import (
    LONG_PROMPT_FLAGS,
    EngineSetting,
    capture_level,
    long_prompts_file,
    require_engine_tier,
    running_engine,
)

pytestmark = [pytest.mark.engine, pytest.mark.slow]

SMALL_CHUNK = 256
LEVEL_S = 30.0


def test_sglang_long_prompts_in_small_chunks_name_the_prefill_budget(tmp_path: Path) -> None:
    require_engine_tier()
    prompts = long_prompts_file(tmp_path / "prompts.jsonl")
    setting = EngineSetting("sglang", "chunk256",
                            (*LONG_PROMPT_FLAGS, "--chunked-prefill-size", str(SMALL_CHUNK)))
    run = tmp_path / "run"
    with running_engine(setting, tmp_path / "sglang.log") as engine:
        out = capture_level(engine, run, concurrency=8, level_s=LEVEL_S, max_tokens=32, prompts=prompts,
                            report=True)
    assert out.returncode == 0, out.stderr[-3000:]
    findings = json.loads((run / "report" / "findings.json").read_text())["findings"]
    named = [f for f in findings if f["cause"] == "prefill_budget"]
    assert named, [(f["cause"], f["summary"]) for f in findings]
    change = named[0]["change"]
    assert change["knob"] == "--chunked-prefill-size" and change["value"] > SMALL_CHUNK, change
    assert named[0]["evidence"]["prefill_budget_tokens"] == SMALL_CHUNK, named[0]["evidence"]
    report = (run / "report" / "report.md").read_text()
    assert "prefill_budget (phase C=8" in report and f"--chunked-prefill-size {change['value']}" in report, \
        report[:3000]
