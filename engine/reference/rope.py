"""RoPE frequency scaling shared by the target and drafter forwards (transformers' variants)."""

from __future__ import annotations

import math

import torch


def scale_inv_freq(inv_freq: torch.Tensor, kind: str, scaling: dict | None) -> torch.Tensor:
    """Apply a rope_scaling variant ("default", "linear" or "llama3") to inverse frequencies."""
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor, low, high = float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    return inv_freq
