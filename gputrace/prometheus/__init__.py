"""Reading gputrace's metrics back from a Prometheus server (HTTP API) into a run store."""
