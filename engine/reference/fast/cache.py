"""A preallocated KV cache: one buffer per K and V for all layers, allocated once per session.

Rows [0, length) are the context (committed rows plus the rows of the last verify not yet
compacted), exactly what a DynamicCache's get_seq_length would say after the same calls. Rows past
`length` hold stale or padding values that no query ever sees. The buffers are zero-initialised
because a masked key still multiplies its value row by a zero probability, and 0 * NaN is NaN.

CUDA graphs bake in these buffers' addresses, so what is captured for a cache lives on it:
`stages` (query bucket -> the static input and output buffers), `graphs` ((query bucket, KV
bucket) -> captured forward) and `walks` (query bucket -> the walk and commit). One cache serves
one session at a time; `share()` hands a session its own object over the same buffers, so that a
session dropped without being closed can be noticed (the slot pool in backend.py watches it).

Attention on the static path reads the first `kv` rows only, kv the smallest of `kv_buckets(rows)`
that holds the context and the new rows: a 1k-token context in an 8k window reads 1.5k rows, not
8k. The buckets grow geometrically from KV_MIN, so a session passes through a handful of them.
"""

from __future__ import annotations

import torch

from ddtree.engine.reference.errors import DecodeError

# Rows are rounded up to this so that masks over all rows keep an aligned last dimension
# (the memory-efficient SDPA kernel otherwise pads a copy of the mask on every call).
ROW_ALIGN = 64
# The smallest attended length of the static path: below it the KV read costs less than a launch.
KV_MIN = 256
# From here on the buckets also take the midpoint 1.5x between two powers of two, so a context
# just past a power of two (a 1k prompt) reads at most 1.5x its rows, not 2x.
KV_FINE = 1024


def kv_buckets(rows: int, smallest: int = KV_MIN) -> tuple[int, ...]:
    """Attended lengths of a cache of `rows` rows, ascending: smallest, 2*smallest, ... and from
    KV_FINE on 1.5x midpoints too (1024, 1536, 2048, 3072, ...), all below rows, then rows.

    Each is a multiple of ROW_ALIGN when smallest is (rows always is)."""
    if rows < 1 or smallest < 1:
        raise DecodeError(f"KV buckets need rows >= 1 and smallest >= 1, got {rows} and {smallest}")
    out = []
    size = smallest
    while size < rows:
        out.append(size)
        if size >= KV_FINE and size * 3 // 2 < rows:
            out.append(size * 3 // 2)
        size *= 2
    out.append(rows)
    return tuple(out)


def kv_bucket(rows: int, needed: int, buckets: tuple[int, ...] | None = None) -> int:
    """The smallest bucket >= needed (rows when none is)."""
    for size in buckets if buckets is not None else kv_buckets(rows):
        if size >= needed:
            return size
    return rows


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
        self.stages: dict[int, object] = {}
        self.graphs: dict[tuple[int, int], object] = {}
        self.spans: dict[int, list[int]] = {}  # query bucket -> its captured KV spans, ascending
        self.walks: dict[int, object] = {}
        # (start, kept): the walk already moved this verify's accepted rows (see compact).
        self.moved: tuple[int, int] | None = None
        # A drafter's staging rows [r, W] where walks put the accepted features (backend.py
        # pairs a slot's two caches), or None.
        self.sink: torch.Tensor | None = None
        # The drafter's (append count, block ids, its cache): walks put the accepted count and
        # the bonus in the first two (commit.walk_commit_static); or None.
        self.draft_next: tuple | None = None
        # The most nodes a walk can accept (a drafter's block: the bonus and its drafts), so a
        # walk moves only that many K/V rows; None: up to the whole query.
        self.max_path: int | None = None
        # The KV pool slot whose buffers these are (KVPool sets it), or None: read once per
        # session a round, so an attribute, not a lookup by address.
        self.slot: int | None = None

    @classmethod
    def over(cls, k: torch.Tensor, v: torch.Tensor, length_t: torch.Tensor, *, capacity: int,
             slack: int) -> StaticKVCache:
        """A cache over buffers someone else owns (a KV pool's slot, fast/pool.py): k/v
        [layers, kv_heads, rows, d] views, length_t a 0-dim long view that the owner may set for
        many caches in one write."""
        if k.shape != v.shape or k.dim() != 4 or length_t.dim() != 0:
            raise DecodeError(f"a cache over views needs k, v [layers, heads, rows, d] and a 0-dim "
                              f"length, got {tuple(k.shape)}, {tuple(v.shape)}, {tuple(length_t.shape)}")
        if capacity < 1 or slack < 0 or capacity + slack > k.shape[2]:
            raise DecodeError(f"capacity {capacity} + slack {slack} do not fit {k.shape[2]} rows")
        cache = cls.__new__(cls)
        cache.k, cache.v = k, v
        cache.capacity, cache.slack = int(capacity), int(slack)
        cache.length_t = length_t
        cache.stages, cache.graphs, cache.spans, cache.walks = {}, {}, {}, {}
        cache.moved = None
        cache.slot = None
        cache.sink = None
        cache.draft_next = None
        cache.max_path = None
        cache.set_length(0)
        return cache

    def share(self) -> StaticKVCache:
        """A new, empty cache object over these same buffers, stages and graphs (graphs read the
        buffers by address, so they serve it). The two must not be used at the same time."""
        other = StaticKVCache.__new__(StaticKVCache)
        other.k, other.v = self.k, self.v
        other.capacity, other.slack = self.capacity, self.slack
        other.length_t = self.length_t
        other.stages, other.graphs, other.walks = self.stages, self.graphs, self.walks
        other.spans = self.spans
        other.sink = self.sink
        other.draft_next = self.draft_next
        other.max_path = self.max_path
        other.slot = self.slot
        other.moved = None
        other.set_length(0)
        return other

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
            self.moved = None
            self.set_length(max(0, int(length)))

    def compact(self, start: int, keep: torch.Tensor, keep_list: list[int]) -> None:
        """Move rows start+keep[i] to start+i (keep ascending, keep[0] == 0), then crop after them."""
        n = len(keep_list)
        if n == 0 or start + keep_list[-1] >= self.length:
            raise DecodeError(f"compact keeps rows {start}+{keep_list} of a cache of {self.length} rows")
        moved, self.moved = self.moved, None
        if moved == (start, n):
            # The walk's graph already gathered these rows into place and set length_t to
            # start + n (FastTarget.walk_commit): only the host length is left to set.
            self.length = start + n
            return
        if keep_list[-1] != n - 1:
            # Rows only move to lower indices and index_select reads them all before the write.
            rows = keep.to(self.k.device) + start
            self.k[:, :, start:start + n] = self.k.index_select(2, rows)
            self.v[:, :, start:start + n] = self.v.index_select(2, rows)
        self.set_length(start + n)

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()
