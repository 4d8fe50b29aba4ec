"""The machine: GPUs, NUMA, placement, telemetry sampling, downloads and preflight checks."""
