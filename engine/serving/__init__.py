"""Engines as processes: launch specs, probes, SGLang and vLLM, the benchmark client and metrics."""
