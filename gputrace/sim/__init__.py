"""A discrete-event simulator of an SGLang pipeline-parallel deployment: ground truth for the
diagnosis (virtual time) and the engine behind the demo (real time, OpenAI-compatible HTTP).

``run_scenario(name, seed, overrides)`` runs a preset in virtual time; ``write_store`` (and
``write_log``, ``write_gpu_csv``) turn its result into a run store and files; ``start_sim_server``
serves the model over HTTP.
"""

from gputrace.sim.params import SCENARIOS, Scenario, SimParams, scenario_params
from gputrace.sim.virtual import SimResult, run_params, run_scenario

__all__ = ["SCENARIOS", "Scenario", "SimParams", "SimResult", "run_params", "run_scenario", "scenario_params"]
