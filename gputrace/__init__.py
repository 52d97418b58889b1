"""gputrace: correlate per-GPU utilization with an LLM engine's load to diagnose pipeline bubbles."""

__version__ = "0.1.0"
