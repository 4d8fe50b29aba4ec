"""The target model: one forward wrapper and a KV-cache adapter over transformers versions.

transformers moved the cache around in 5.x (`cache.layers[i].keys` instead of
`cache.key_cache[i]`; `crop` changed meaning) and 5.24 renamed the forward argument
`past_key_values` to `cache`. Everything version-dependent is decided here, once.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

# hybrid_reason lives in ddtree.engine.arch (torch-free, so plans can call it); importable here too.
from ddtree.engine.arch import hybrid_reason

__all__ = ["KVCache", "Target", "ForwardOut", "HeadShapes", "cache_kwarg", "hybrid_reason"]


def cache_kwarg(model: nn.Module) -> str:
    """The forward argument that takes the KV cache: `cache` from transformers 5.24, else `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class KVCache:
    """A transformers DynamicCache plus the two operations decoding needs: crop and compact."""

    def __init__(self, cache) -> None:
        self.cache = cache

    @classmethod
    def new(cls, model: nn.Module) -> KVCache:
        from transformers import DynamicCache

        try:
            return cls(DynamicCache(config=model.config))
        except TypeError:  # transformers without the config argument
            return cls(DynamicCache())

    def _pairs(self):
        layers = getattr(self.cache, "layers", None)
        if layers is not None:
            return [(layer, "keys", "values") for layer in layers]
        return [(i, None, None) for i in range(len(self.cache.key_cache))]

    def _get(self, entry):
        owner, k_name, v_name = entry
        if k_name is None:
            return self.cache.key_cache[owner], self.cache.value_cache[owner]
        return getattr(owner, k_name, None), getattr(owner, v_name, None)

    def _set(self, entry, k, v) -> None:
        owner, k_name, v_name = entry
        if k_name is None:
            self.cache.key_cache[owner], self.cache.value_cache[owner] = k, v
        else:
            setattr(owner, k_name, k)
            setattr(owner, v_name, v)

    def seq_length(self) -> int:
        return int(self.cache.get_seq_length())

    def crop(self, length: int) -> None:
        """Keep the first `length` rows of every layer."""
        for entry in self._pairs():
            k, v = self._get(entry)
            if k is None or k.dim() < 2 or k.shape[-2] <= length:
                continue
            self._set(entry, k[..., :length, :], v[..., :length, :])

    def compact(self, start: int, keep: torch.Tensor, keep_list: list[int]) -> None:
        """Move rows start+keep[i] to start+i (keep ascending, keep[0] == 0), then crop after them."""
        n = len(keep_list)
        contiguous = keep_list[-1] == n - 1
        for entry in self._pairs():
            k, v = self._get(entry)
            if k is None or k.dim() < 2:
                continue
            if not contiguous:
                # Rows only move to lower indices, and a gather reads before it writes: safe in place.
                rows = keep.to(k.device) + start
                k[..., start:start + n, :] = k.index_select(-2, rows)
                v[..., start:start + n, :] = v.index_select(-2, rows)
            self._set(entry, k[..., :start + n, :], v[..., :start + n, :])

    def tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's (keys, values), [b, heads, rows, head_dim] each."""
        return [self._get(entry) for entry in self._pairs()]

    def assign(self, tensors: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Replace every layer's keys/values (the layers must already exist, e.g. after a prefill)."""
        entries = self._pairs()
        if len(entries) != len(tensors):
            raise ValueError(f"cache has {len(entries)} layers, got {len(tensors)}")
        for entry, (k, v) in zip(entries, tensors):
            self._set(entry, k, v)

    @classmethod
    def of(cls, model: nn.Module, tensors: list[tuple[torch.Tensor, torch.Tensor]]) -> KVCache:
        """A new cache holding these tensors as its layers (no copy)."""
        cache = cls.new(model)
        for i, (k, v) in enumerate(tensors):
            # An empty update creates and initialises layer i the way this transformers version does it.
            cache.cache.update(k[..., :0, :], v[..., :0, :], i)
        cache.assign(tensors)
        return cache

    def nbytes(self) -> int:
        total = 0
        for entry in self._pairs():
            k, v = self._get(entry)
            if k is not None and k.dim() >= 2:
                total += k.numel() * k.element_size() + v.numel() * v.element_size()
        return total


@dataclass
class ForwardOut:
    logits: torch.Tensor            # [n, V] float32
    features: torch.Tensor | None   # [n, K*H] in the model dtype, or None


class HeadShapes:
    """vocab_size and hidden_size read off `lm_head` and `embed` (both target kinds have them)."""

    lm_head: nn.Module
    embed: nn.Module

    @property
    def vocab_size(self) -> int:
        return int(self.lm_head.weight.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.embed.weight.shape[1])


class Target(HeadShapes):
    """A causal LM from transformers, called the way the decoders need it."""

    def __init__(self, model: nn.Module, feature_layers: tuple[int, ...] = ()) -> None:
        self.model = model
        self.feature_layers = tuple(feature_layers)
        self.cache_kwarg = cache_kwarg(model)
        self.has_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.embed = model.get_input_embeddings()
        self.lm_head = model.get_output_embeddings()
        self.config = model.config
        self.num_layers = int(getattr(model.config, "num_hidden_layers", 0))
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype

    def new_cache(self) -> KVCache:
        return KVCache.new(self.model)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache,
                attention_mask: torch.Tensor | None = None, *, features: bool = False,
                last_only: bool = False) -> ForwardOut:
        """input_ids/position_ids [n] -> logits [n or 1, V]; attention_mask additive [1,1,n,kv]."""
        kwargs = {
            "input_ids": input_ids.unsqueeze(0),
            "position_ids": position_ids.unsqueeze(0),
            self.cache_kwarg: cache.cache,
            "use_cache": True,
            "output_hidden_states": features,
        }
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if last_only and self.has_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        out = self.model(**kwargs)
        logits = out.logits[0]
        if last_only:
            logits = logits[-1:]
        feats = None
        if features:
            feats = torch.cat([out.hidden_states[i + 1][0] for i in self.feature_layers], dim=-1)
        return ForwardOut(logits=logits.float(), features=feats)

    def forward_batch(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache,
                      attention_mask: torch.Tensor, *, features: bool = False,
                      keep: torch.Tensor | None = None) -> ForwardOut:
        """input_ids/position_ids [b, q], additive mask [b, 1, q, kv] -> logits [b, q, V] (model dtype).

        Logits stay in the model dtype: callers convert only the rows they read, which matters
        with a 150k vocabulary and padded rows. `keep` (row indices) asks for logits at those rows
        only, [b, len(keep), V], where the model supports it; otherwise all rows come back.
        """
        kwargs = {
            "input_ids": input_ids,
            "position_ids": position_ids,
            self.cache_kwarg: cache.cache,
            "use_cache": True,
            "output_hidden_states": features,
            "attention_mask": attention_mask,
        }
        if keep is not None and self.has_logits_to_keep:
            kwargs["logits_to_keep"] = keep
        out = self.model(**kwargs)
        feats = None
        if features:
            feats = torch.cat([out.hidden_states[i + 1] for i in self.feature_layers], dim=-1)
        return ForwardOut(logits=out.logits, features=feats)
