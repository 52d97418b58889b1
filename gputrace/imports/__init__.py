"""Importers: files and services other tools wrote (engine logs, AIPerf, guidellm, gputrace's own
requests JSONL, nvidia-smi captures, a Prometheus range) read into a run store. Each returns one
ImportReport and writes through ``gputrace.imports.report.write_rows``."""
