"""The bubble diagnosis: pure functions over a run's columns (no I/O to hosts, no store).

A run is analysed with ``gputrace.analyse.analyse_run``, the one entry every command, the demo and
the benchmarks take (alignment, phases, metrics, diagnosis, then the what-if's predicted effects
and the advice); the pieces (``aligned_run``, ``phases``, ``phase_figures``, ``diagnose``,
``compare``) are usable on their own, ``result.analyse_tables`` on tables built in memory.
"""

from gputrace.analysis.result import Analysis

__all__ = ["Analysis"]
