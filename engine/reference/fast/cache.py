"""A preallocated KV cache: one buffer per K and V for all layers, allocated once per session.

Rows [0, length) are the context (committed rows plus the rows of the last verify not yet
compacted), exactly what a DynamicCache's get_seq_length would say after the same calls. Rows past
`length` hold stale or padding values that no query ever sees. The buffers are zero-initialised
because a masked key still multiplies its value row by a zero probability, and 0 * NaN is NaN.

CUDA graphs bake in these buffers' addresses, so the graphs captured for a cache live on it
(`graphs`, bucket size -> captured graph), and one cache serves one session at a time.
"""

from __future__ import annotations

import torch

from ddtree.engine.reference.errors import DecodeError

# Rows are rounded up to this so that masks over all rows keep an aligned last dimension
# (the memory-efficient SDPA kernel otherwise pads a copy of the mask on every call).
ROW_ALIGN = 64


class StaticKVCache:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, capacity: int, *,
                 slack: int = 0, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        """capacity: rows the context may fill; slack: rows past it that padded queries may write."""
        if capacity < 1 or slack < 0:
            raise DecodeError(f"KV cache needs capacity >= 1 and slack >= 0, got {capacity} and {slack}")
        rows = -(-(capacity + slack) // ROW_ALIGN) * ROW_ALIGN
        shape = (num_layers, kv_heads, rows, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)   # [layers, kv_heads, rows, d]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = int(capacity)
        self.slack = int(slack)
        self.length = 0
        # The same number on the device, for graphs: they read it instead of a baked-in constant.
        self.length_t = torch.zeros((), dtype=torch.long, device=device)
        self.graphs: dict[int, object] = {}

    @property
    def rows(self) -> int:
        """Allocated rows: capacity + slack, rounded up to ROW_ALIGN."""
        return int(self.k.shape[2])

    @property
    def device(self) -> torch.device:
        return self.k.device

    def seq_length(self) -> int:
        return self.length

    def set_length(self, length: int) -> None:
        if not 0 <= length <= self.rows:
            raise DecodeError(f"KV cache length {length} outside 0..{self.rows}")
        self.length = int(length)
        self.length_t.fill_(self.length)  # a device-side fill: no host sync

    def crop(self, length: int) -> None:
        """Keep the first `length` rows (a longer length is a no-op, as for DynamicCache)."""
        if length < self.length:
            self.set_length(max(0, int(length)))

    def compact(self, start: int, keep: torch.Tensor, keep_list: list[int]) -> None:
        """Move rows start+keep[i] to start+i (keep ascending, keep[0] == 0), then crop after them."""
        n = len(keep_list)
        if n == 0 or start + keep_list[-1] >= self.length:
            raise DecodeError(f"compact keeps rows {start}+{keep_list} of a cache of {self.length} rows")
        if keep_list[-1] != n - 1:
            # Rows only move to lower indices and index_select reads them all before the write.
            rows = keep.to(self.k.device) + start
            self.k[:, :, start:start + n] = self.k.index_select(2, rows)
            self.v[:, :, start:start + n] = self.v.index_select(2, rows)
        self.set_length(start + n)

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()
