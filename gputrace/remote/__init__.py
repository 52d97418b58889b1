"""Reaching hosts: transports (local, SSH), following logs with resume, clock-offset probes."""
