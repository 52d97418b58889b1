"""[engines] The knob reference (docs/knobs-<engine>.md) is generated from the knob registry and
must not drift from it: a page that differs from what `gputrace knobs --out docs` writes fails."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from gputrace.engines import ENGINE_WORDS
from gputrace.engines.reference import knob_reference, page_name
from gputrace.vocabulary import Cause

DOCS = Path(__file__).resolve().parent.parent / "docs"


@pytest.mark.parametrize("kind", sorted(ENGINE_WORDS))
def test_the_knob_page_is_the_registrys(kind: str) -> None:
    """docs/knobs-<engine>.md is what the registry gives today (regenerate: make docs-knobs)."""
    engine = ENGINE_WORDS[kind]
    page = DOCS / page_name(engine)
    assert page.exists(), f"{page} missing: run `make docs-knobs`"
    assert page.read_text() == knob_reference(engine), f"{page} drifted from the registry: make docs-knobs"


def test_the_page_follows_a_changed_knob() -> None:
    """A knob changed in the registry (its default) changes its engine's page: the check above sees
    drift, not only a missing file."""
    engine = ENGINE_WORDS["sglang"]
    knobs = tuple(dataclasses.replace(k, default_text="1") if k.name == "decode_log_interval" else k
                  for k in engine.knobs)
    changed = dataclasses.replace(engine, knobs=knobs)
    assert knob_reference(changed) != knob_reference(engine)
    row = next(line for line in knob_reference(changed).splitlines() if "--decode-log-interval" in line)
    assert "| 1 |" in row


def test_gputrace_knobs_writes_the_pages(tmp_path: Path) -> None:
    """`gputrace knobs --out DIR` writes one page per registered engine, the ones in docs/; with an
    engine it prints that engine's page; an unknown engine is one line, exit 2."""
    out = subprocess.run([sys.executable, "-m", "gputrace", "knobs", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for engine in ENGINE_WORDS.values():
        assert (tmp_path / page_name(engine)).read_text() == (DOCS / page_name(engine)).read_text()
    shown = subprocess.run([sys.executable, "-m", "gputrace", "knobs", "vllm"], capture_output=True,
                           text=True, timeout=60)
    assert shown.returncode == 0 and shown.stdout == knob_reference(ENGINE_WORDS["vllm"])
    bad = subprocess.run([sys.executable, "-m", "gputrace", "knobs", "trtllm"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "sglang" in bad.stderr


def test_every_knob_is_well_formed() -> None:
    """Each knob names causes the diagnosis has, one flag per knob and engine, its own name once, a
    default that follows from the settings where it has one (SGLang's K: max(pool // pp_size, 1))."""
    causes = {c.value for c in Cause}
    for engine in ENGINE_WORDS.values():
        flags = [k.flag for k in engine.knobs]
        assert len(flags) == len(set(flags)), engine.kind
        assert len({k.own_name for k in engine.knobs}) == len(engine.knobs), engine.kind
        for knob in engine.knobs:
            assert set(knob.causes) <= causes, (engine.kind, knob.name)
            assert knob.type in (int, float, str)
    k = ENGINE_WORDS["sglang"].knob_named("pp_max_micro_batch_size")
    assert k is not None and k.default_for({"max_running_requests": 64, "pp_size": 8}) == 8
    assert k.default_for({"max_running_requests": 3, "pp_size": 8}) == 1
    assert k.default_for({"pp_size": 8}) is None
