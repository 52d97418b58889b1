"""GPU sources: the NVML backend, the simulated backend and the Sampler interface they share."""
