"""The collector (``Collector``): for one run, per host one transport that follows the engine log,
pulls the agent's samples and probes the clock, into the run store; a small HTTP server serves live
metrics, phase marks and status."""

from gputrace.collect.collector import DEFAULT_LISTEN, CollectOptions, Collector, LoadInFlight
from gputrace.collect.marks import marker_from_json
from gputrace.collect.run_store import install_stop_signals, open_run_store

__all__ = ["DEFAULT_LISTEN", "CollectOptions", "Collector", "LoadInFlight", "install_stop_signals",
           "marker_from_json", "open_run_store"]
