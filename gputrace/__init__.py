"""gputrace: correlate per-GPU utilization with an LLM engine's load to diagnose pipeline bubbles."""

import os

# numpy's OpenBLAS starts a thread per core when numpy is imported, and they spin waiting for work
# gputrace never gives them (its one least-squares fit is 2 columns wide): 0.04 CPU s of every
# command's start (0.12 -> 0.085 s for `import numpy` on 2 cores), 11 % of the whole bare regex
# scan `gputrace import` is measured against (bench/ingest.py). A user's own setting is kept.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

__version__ = "0.1.0"
