"""The per-host agent: samples GPUs into a ring buffer and serves /metrics and /v1/samples."""
