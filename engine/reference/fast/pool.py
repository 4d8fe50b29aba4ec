"""One preallocated KV pool for the fast backend's sessions: the target's and the drafter's rows.

The pool holds `slots` sequences. Target K/V live in one buffer per K and V, [layers, slots,
kv_heads, rows, d]; the drafter's context K/V likewise, [layers, slots, kv_heads, rows', d].
Slot i's StaticKVCache and DraftContextCache are views of row i, and their device lengths are
elements of one `lengths` vector per model, so a batched round (fast/batch.py) reads every
session's rows in place, as pool[:, :b], and sets every length in one write. Nothing is stacked,
padded or copied per round; a session owns its slot from its start to its end.

Sessions lease slots lowest index first (FastPath.new_caches), so the running sessions fill
slots 0..b-1 and a batched round over them reads one contiguous block of the pool.

Sizing: `bytes_per_token` is what one context token costs in K/V (both models); a slot holds
`slot_tokens` tokens (the context window plus the largest query's slack), so `slots_for(bytes)`
says how many sequences a memory budget admits (the server's --kv-pool-gb).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ddtree.engine.reference.errors import BadParams
from ddtree.engine.reference.fast.cache import StaticKVCache

if TYPE_CHECKING:
    from ddtree.engine.reference.fast.draft import DraftContextCache, FastDrafter
    from ddtree.engine.reference.fast.target import FastTarget


def _row_bytes(target: FastTarget, drafter: FastDrafter | None) -> tuple[int, int]:
    """K/V bytes of one cache row in the target and in the drafter (0 when there is none)."""
    cfg = target.cfg
    per_target = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * target.dtype.itemsize
    per_draft = 0
    if drafter is not None:
        # KVPool allocates the drafter's rows in the drafter's dtype, which may differ.
        per_draft = 2 * drafter.num_layers * drafter.num_kv_heads * drafter.head_dim * drafter.dtype.itemsize
    return per_target, per_draft


def bytes_per_token(target: FastTarget, drafter: FastDrafter | None) -> int:
    """K/V bytes one context token costs in the target (and the drafter, when there is one)."""
    return sum(_row_bytes(target, drafter))


def slot_bytes(target: FastTarget, drafter: FastDrafter | None) -> int:
    """Bytes of one slot: every row of the target's cache and of the drafter's."""
    per_target, per_draft = _row_bytes(target, drafter)
    total = per_target * target.new_cache_rows()
    if drafter is not None:
        total += per_draft * (drafter.capacity + drafter.block_size + 1)
    return total


def slots_for(budget_bytes: int, target: FastTarget, drafter: FastDrafter | None) -> int:
    """How many sequences a pool of budget_bytes holds (0 when not even one fits)."""
    return max(0, int(budget_bytes) // slot_bytes(target, drafter))


class KVPool:
    def __init__(self, target: FastTarget, drafter: FastDrafter | None, slots: int) -> None:
        if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
            raise BadParams(f"a KV pool needs at least one slot, got {slots!r}")
        cfg = target.cfg
        device, dtype = target.device, target.dtype
        self.slots = slots
        rows = target.new_cache_rows()
        shape = (cfg.num_hidden_layers, slots, cfg.num_key_value_heads, rows, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(slots, dtype=torch.long, device=device)
        self.caches: list[StaticKVCache] = []
        for i in range(slots):
            cache = StaticKVCache.over(self.k[:, i], self.v[:, i], self.lengths[i],
                                       capacity=target.context_window, slack=target.buckets[-1])
            cache.slot = i
            self.caches.append(cache)
        self.draft_caches: list[DraftContextCache | None] = [None] * slots
        self.dk = self.dv = self.dlengths = None
        if drafter is not None:
            from ddtree.engine.reference.fast.draft import DraftContextCache

            dshape = (drafter.num_layers, slots, drafter.num_kv_heads,
                      drafter.capacity + drafter.block_size + 1, drafter.head_dim)
            self.dk = torch.zeros(dshape, dtype=drafter.dtype, device=device)
            self.dv = torch.zeros(dshape, dtype=drafter.dtype, device=device)
            self.dlengths = torch.zeros(slots, dtype=torch.long, device=device)
            for i in range(slots):
                draft = DraftContextCache(self.dk[:, i], self.dv[:, i], drafter.capacity)
                draft.length_t = self.dlengths[i]
                self.draft_caches[i] = draft
        self.bytes_per_token = bytes_per_token(target, drafter)
        self.slot_tokens = rows

    def index_of(self, cache) -> int | None:
        """The slot whose buffers this target cache views, or None (not a pool cache): the
        slot each pool cache and its shares carry (StaticKVCache.slot)."""
        return getattr(cache, "slot", None)

    def nbytes(self) -> int:
        total = self.k.numel() * self.k.element_size() * 2
        if self.dk is not None:
            total += self.dk.numel() * self.dk.element_size() * 2
        return total
