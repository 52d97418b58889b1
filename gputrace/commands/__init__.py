"""One module per CLI command; each exposes ``command`` (a click command or group).

Commands are thin: parse arguments, call the library, print. gputrace/cli.py lists them.
"""

# The one line `gputrace --help` lists for each command, kept here so that listing the commands
# imports none of them (their modules pull in DuckDB, matplotlib, asyncssh: 1.6 s and 155 MB).
SUMMARIES: dict[str, str] = {
    "agent": "Sample this host's GPUs and serve them (NVML or simulated).",
    "check-config": "Validate a gputrace.toml and show what it describes.",
    "collect": "Capture a run: engine logs, GPU samples, clocks.",
    "compare": "Compare run B against run A, phase by phase.",
    "demo": "The whole chain on a simulated SGLang PP8, no GPU.",
    "export": "Export a run (Parquet, Perfetto).",
    "import": "Import engine logs, load results, nvidia-smi files.",
    "knobs": "Each engine's knobs: flag, default, range, what it limits.",
    "load": "Keep C requests in flight per level; report each.",
    "mark": "Mark a load phase in the running capture (C=64).",
    "panels": "Render the Grafana dashboard's panels from a Prometheus (PNG).",
    "parse": "Print engine log lines as JSON, one per line.",
    "report": "Diagnose pipeline bubbles and write the report.",
    "run": "Collect while a benchmark runs, then report.",
    "sim": "Simulate an SGLang PP deployment under a sweep.",
    "watch": "Live view: one row per pipeline stage.",
    "whatif": "Predict a change's effect from the simulator fitted to a run.",
}
