"""The load side: a closed-loop concurrency sweep against OpenAI-compatible endpoints (the importers
of other benchmark tools' records live in gputrace.imports)."""

from __future__ import annotations

from gputrace.load.generator import LoadGenerator, LoadResult, LoadSpec, run_load, spec_from_config
from gputrace.load.stats import LevelStats

__all__ = ["LevelStats", "LoadGenerator", "LoadResult", "LoadSpec", "run_load", "spec_from_config"]
