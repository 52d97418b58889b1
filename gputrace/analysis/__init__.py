"""The bubble diagnosis: pure functions over the run store's columns (no I/O to hosts).

Commands analyse a run with ``gputrace.analyse.analyse_run`` (which adds the what-if's predicted
effects and the advice); ``analyse_store(store)`` here runs alignment, phases, metrics and
diagnosis in one call; the pieces (``align``, ``phases``, ``metrics``, ``diagnose``, ``compare``)
are usable on their own.
"""

from gputrace.analysis.result import Analysis, analyse_store

__all__ = ["Analysis", "analyse_store"]
