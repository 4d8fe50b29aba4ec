"""Inference engines: hardware discovery, launch specs, the HTTP client, preflight."""
