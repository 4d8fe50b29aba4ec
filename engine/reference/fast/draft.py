"""The DFlash drafter on static buffers: a preallocated context K/V cache and CUDA graphs.

Same math as drafter.DFlashDrafter with its DraftCache, split the way a round uses it:

- `append` is the context step. The pending target features go through `fc` and `hidden_norm`
  once; every layer's context keys/values come from those same projected features (DFlash injects
  the context into each layer, it does not run it through the stack), so the step is row-wise and
  needs no attention at all.
- `block` is the block forward: [bonus, MASK x (B-1)] at positions start..start+B-1, queries from
  the block only, keys/values = the cached context plus the block's own rows, no causal mask. B is
  always the drafter's trained block size: a shorter engine block only reads fewer rows.

Buffer layout per layer: [kv_heads, capacity + B + 1, head_dim]. Rows [0, length) hold the
context; the block writes its own keys/values at [length, length + B) before attending, so the
eager path attends over the slice [:length + B] with no mask and no concatenation. The last row is
scratch: padded append rows that would run past the end are clamped onto it.

The static path (what CUDA graphs capture) has fixed shapes and never reads a host value: the
block attends over the whole buffer, masked on the device by `length_t`; append is padded to a
bucket of rows whose pad rows land past the new length, where the next block overwrites them or
the mask hides them. Rows past `length` may hold stale values; they are always finite (buffers
start zeroed and only ever receive computed rows), so a masked zero weight times them stays zero.

Attention folds the query heads of each kv head into the query axis ([1, kv_heads, G*B, d]):
every query row sees the same keys (no causal mask), so grouped-query attention needs neither
repeat_interleave nor enable_gqa, and every SDPA backend accepts it. On CUDA it is two GEMMs
around a float32 softmax (the target's "matmul" kernel, model.py): the fused SDPA kernels gave
the few block queries a handful of thread blocks for the whole buffer (128 us a layer for the
demo drafter in float32 on an H200, against about 10 for the GEMMs).

Each layer's q/k/v projections run as one product, and so do gate/up, as the target's do
(model._fuse_linears: the drafter's own weights become views of the joined one); the context
step's k/v is a slice of the q/k/v weight. On an H200 every few-row float32 product cost 4-7 us
in a demo round (bench/RESULTS.md), so the products this saves (three a layer in the block, one
in the context step) count.

The linears go through fast/rows.RowLinears, which measures at capture time whether a few-row
float32 product runs faster with its operands swapped. The batched drafter of pooled rounds
(fast/batch.py) keeps SDPA, and its products go through the same RowLinears, which take F.linear
at row counts the tune never measured. At one session (16 rows) an H200 profile of that batched round
showed 8 float32 GEMMs of 40 us each on cuBLAS's 32x128 tiles (bench/RESULTS.md), likely the two
layers' q, k, v and o at 16 rows, which bench_small_gemm timed at 31-52 us: the joined q/k/v is
one wider product (16 x 256 x 512 took 3.3 us there), and o takes the tune's choice.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.engine.reference.drafter import DFlashDrafter, rope_inv_freq
from ddtree.engine.reference.errors import BadParams
from ddtree.engine.reference.fast.graphs import record_graph, warming_up
from ddtree.engine.reference.fast import tree_attention as fused
from ddtree.engine.reference.fast.model import _fuse_linears, choose_attention, eager_kernel, matmul_attention
from ddtree.engine.reference.fast.rows import RowLinears

_WARMUP_RUNS = 3  # side-stream runs before a capture, as torch's CUDA graph notes advise


class Joined:
    """A product standing for several linears joined along their outputs (or a slice of such):
    weight, bias and a call, all RowLinears asks of a module."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


@dataclass
class LayerJoins:
    qkv: Joined      # [q; k; v] for the block's rows
    kv: Joined       # its [k; v] rows, for the context step's
    gate_up: Joined  # [gate; up]
    split: tuple[int, int, int]  # q, k, v widths


def join_layer(layer: nn.Module) -> LayerJoins:
    """One layer's joined products; its q/k/v and gate/up weights become views of them. A layer
    joined before, whose weights are still those views, gets the same joins back: a second fast
    engine on the same drafter would otherwise join copies, and the first keep its own, twice
    the memory of these weights."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv, gate_up = (attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)
    ref = _JOINS.get(layer)
    known = ref() if ref is not None else None
    if known is not None and _views_of(known.qkv, qkv) and _views_of(known.gate_up, gate_up):
        return known
    widths = tuple(int(lin.weight.shape[0]) for lin in qkv)
    weight, bias = _fuse_linears(qkv)
    kv = Joined(weight[widths[0]:], None if bias is None else bias[widths[0]:])
    joins = LayerJoins(Joined(weight, bias), kv, Joined(*_fuse_linears(gate_up)), widths)
    _JOINS[layer] = weakref.ref(joins)
    return joins


# Each drafter layer's joins, while a fast drafter holds them: weak both ways, so joins a
# module.to() has left stale are not kept alive by the layer, and nothing rides on the module.
_JOINS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _views_of(joined: Joined, linears) -> bool:
    """Whether these linears' weights and biases are, in order, the rows of the joined ones (not
    so once a module.to() or a load has replaced them)."""
    for whole, parts in ((joined.weight, [lin.weight for lin in linears]),
                         (joined.bias, [lin.bias for lin in linears])):
        if whole is None:
            if any(p is not None for p in parts):
                return False
            continue
        at = whole.storage_offset()
        for part in parts:
            if (part is None or part.dtype != whole.dtype or part.device != whole.device
                    or part.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr()
                    or part.storage_offset() != at):
                return False
            at += part.numel()
        if at != whole.storage_offset() + whole.numel():
            return False
    return True


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, d], cos/sin [n, d]."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


def default_buckets(block_size: int) -> tuple[int, ...]:
    """Powers of two below the block size, then the block size: a round appends 1..B rows."""
    out = []
    size = 1
    while size < block_size:
        out.append(size)
        size *= 2
    out.append(block_size)
    return tuple(out)


@dataclass
class _StaticIO:
    """The fixed-address inputs the static path reads (graphs bake these addresses in)."""

    ids: torch.Tensor          # [B] long: bonus then MASK x (B-1)
    start: torch.Tensor        # 0-dim long: the block's first position
    count: torch.Tensor        # 0-dim long: real rows in the padded append
    feats: torch.Tensor        # [max bucket, K*H]: the padded append's features
    rows: torch.Tensor         # arange(max(B, max bucket)) long
    cols: torch.Tensor         # arange(buffer rows) long
    buckets: tuple[int, ...]   # ascending append bucket sizes (may be empty: appends run eager)
    out: torch.Tensor          # [B-1, V] float32: what a whole draft step (append + block) writes
    bonus_set: int | None = None  # the bonus ids[0] holds now (None: unknown)
    count_set: int | None = None  # the count `count` holds now
    # (context rows before it, count, bonus) of a draft step already run ahead on these inputs
    # (FastDrafter.draft_ahead): its rows are in and length_t counts them, the host length not yet.
    ahead: tuple[int, int, int] | None = None


@dataclass
class _Graphs:
    block: torch.cuda.CUDAGraph
    block_out: torch.Tensor                    # [B-1, V] float32, rewritten by every replay
    appends: dict[int, torch.cuda.CUDAGraph]   # bucket -> graph
    # bucket -> the whole draft step: append that bucket, then the block at the new length,
    # logits into static.out (one replay a round instead of two, and no start to fill).
    drafts: dict[int, torch.cuda.CUDAGraph]


class DraftContextCache:
    """One sequence's drafter context keys/values on preallocated buffers.

    keys/values: [layers, kv_heads, capacity + B + 1, head_dim]. `length` (host int) and
    `length_t` (device 0-dim long) both count the context rows; the static path reads only
    `length_t`, so a graph replay needs no host value.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        self.keys = keys
        self.values = values
        self.capacity = capacity
        self.length = 0
        self.length_t = torch.zeros((), dtype=torch.long, device=keys.device)
        self.static: _StaticIO | None = None
        self.graphs: _Graphs | None = None

    @property
    def rows(self) -> int:
        return self.keys.shape[2]

    def seq_length(self) -> int:
        return self.length

    def nbytes(self) -> int:
        """Bytes of the key/value buffers (the static inputs and graph pools are small beside them)."""
        return self.keys.numel() * self.keys.element_size() * 2

    def share(self) -> DraftContextCache:
        """A new, empty cache object over these same buffers, static inputs and graphs (see
        StaticKVCache.share). The two must not be used at the same time."""
        other = DraftContextCache(self.keys, self.values, self.capacity)
        other.length_t = self.length_t
        other.static, other.graphs = self.static, self.graphs
        other.reset()
        return other

    def reset(self) -> None:
        """Empty the cache in place, keeping its buffers and graphs for the next sequence."""
        self.length = 0
        self.length_t.zero_()
        if self.static is not None:
            self.static.ahead = None


class FastDrafter:
    """A DFlash drafter forward over static buffers, reusing a loaded DFlashDrafter's parameters.

    embed: token ids [n] -> [n, H] (the target's input embedding); lm_head: [n, H] -> [n, V].
    capacity: the most context rows one cache holds (the longest sequence it will draft for).
    attention: "sdpa", "matmul", "triton" or "auto" (model.choose_attention, as FastTarget's).
    """

    def __init__(self, drafter: DFlashDrafter, embed: nn.Module, lm_head: nn.Module, *,
                 capacity: int, mask_token_id: int, attention: str = "auto") -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise BadParams(f"drafter cache capacity must be a positive integer, got {capacity!r}")
        if not isinstance(mask_token_id, int) or mask_token_id < 0:
            raise BadParams(f"mask_token_id must be a non-negative integer, got {mask_token_id!r}",
                            "the drafter config or the engine names the mask token")
        cfg = drafter.config
        self.drafter = drafter
        self.embed = embed
        self.lm_head = lm_head
        self.capacity = capacity
        self.mask_token_id = mask_token_id
        self.block_size = cfg.block_size
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.groups = self.num_heads // self.num_kv_heads
        self.scaling = cfg.head_dim ** -0.5
        weight = drafter.fc.weight
        self.device = weight.device
        self.dtype = weight.dtype
        self.feature_width = weight.shape[1]
        self.vocab_size = int(lm_head.weight.shape[0])
        # Kept in float32 whatever the model dtype, as DFlashDrafter keeps its own.
        self.inv_freq = rope_inv_freq(cfg).to(self.device)
        self.attention = choose_attention(attention, self.device, self.head_dim)
        self.eager_attention = eager_kernel(self.attention, self.device)
        self.linear = RowLinears(self.device, self.dtype)
        with torch.no_grad():
            self.joins = [join_layer(layer) for layer in drafter.layers]  # by layer index
        self._pool = None  # one CUDA graph memory pool for every capture of this drafter
        self._compiled_block = None  # set by compile()

    # ---- caches ------------------------------------------------------------------------------
    def new_cache(self, *, append_buckets: Sequence[int] | None = None) -> DraftContextCache:
        """A zeroed cache. append_buckets=None: the eager path (slices by the host length). A
        sequence (possibly empty): the static path, appends padded to those row counts (larger
        appends, such as a long prompt, run eager); `capture` then records it as graphs."""
        shape = (self.num_layers, self.num_kv_heads, self.capacity + self.block_size + 1, self.head_dim)
        keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        cache = DraftContextCache(keys, torch.zeros_like(keys), self.capacity)
        if append_buckets is not None:
            self._make_static(cache, append_buckets)
        return cache

    def _make_static(self, cache: DraftContextCache, append_buckets: Sequence[int]) -> None:
        buckets = tuple(sorted(set(append_buckets)))
        bad = [b for b in buckets
               if not isinstance(b, int) or isinstance(b, bool) or not 1 <= b <= self.capacity]
        if bad:
            raise BadParams(f"append buckets {bad} are not row counts in 1..{self.capacity}")
        device = self.device
        ids = torch.full((self.block_size,), self.mask_token_id, dtype=torch.long, device=device)
        widest = max(buckets, default=1)
        cache.static = _StaticIO(
            ids=ids,
            start=torch.zeros((), dtype=torch.long, device=device),
            count=torch.zeros((), dtype=torch.long, device=device),
            feats=torch.zeros((widest, self.feature_width), dtype=self.dtype, device=device),
            rows=torch.arange(max(self.block_size, widest), device=device),
            cols=torch.arange(cache.rows, device=device),
            buckets=buckets,
            out=torch.zeros((self.block_size - 1, self.vocab_size), dtype=torch.float32, device=device),
        )
        cache.graphs = None  # graphs recorded for other inputs would be stale

    # ---- graphs ------------------------------------------------------------------------------
    @torch.no_grad()
    def capture(self, cache: DraftContextCache, append_buckets: Sequence[int] | None = None) -> None:
        """Record CUDA graphs of the block forward and of each append bucket, kept on the cache.

        append_buckets: None keeps a static cache's own buckets (an eager cache gets
        `default_buckets(block_size)`). Capture needs nothing from the cache's contents and leaves
        them as they were. Later calls on this cache replay the graphs.
        """
        if cache.keys.device.type != "cuda":
            raise BadParams("CUDA graphs need a cache on a CUDA device", "run the eager or static path")
        if append_buckets is None:
            append_buckets = cache.static.buckets if cache.static else default_buckets(self.block_size)
        self._make_static(cache, append_buckets)
        self.tune(cache.static.buckets)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        static = cache.static
        # Warm-ups and captures append zero real rows: pad rows land past length, length stays.
        static.count.zero_()
        static.count_set = static.bonus_set = None
        block, block_out = self._record(lambda: self._block_static(cache))
        appends = {b: self._record(lambda b=b: self._append_static(cache, b))[0] for b in static.buckets}
        drafts = {b: self._record(lambda b=b: self._draft_static(cache, b))[0] for b in static.buckets}
        cache.graphs = _Graphs(block=block, block_out=block_out, appends=appends, drafts=drafts)

    def tune(self, append_buckets: Sequence[int]) -> None:
        """Measure the few-row linears at the row counts a round uses (RowLinears.tune): the
        block's at B rows, the head's at B-1, the context step's at each append bucket."""
        layers = self.drafter.layers
        joins = self.joins
        block = [m for layer, j in zip(layers, joins)
                 for m in (j.qkv, layer.self_attn.o_proj, j.gate_up, layer.mlp.down_proj)]
        self.linear.tune(block, [self.block_size])
        self.linear.tune([self.lm_head], [self.block_size - 1])
        context = [self.drafter.fc] + [j.kv for j in joins]
        self.linear.tune(context, append_buckets)

    def _record(self, fn):
        return record_graph(fn, self._pool, self.device, _WARMUP_RUNS)

    # ---- the context step --------------------------------------------------------------------
    @torch.no_grad()
    def append(self, pending: torch.Tensor, cache: DraftContextCache) -> None:
        """Add the features [p, K*H] of positions length..length+p-1 to the cache."""
        self.settle(cache)
        if pending.dim() != 2 or pending.shape[1] != self.feature_width:
            raise BadParams(f"pending features must be [rows, {self.feature_width}], got {tuple(pending.shape)}")
        p = pending.shape[0]
        if p == 0:
            return
        if cache.length + p > cache.capacity:
            raise BadParams(f"drafter cache full: {cache.length} + {p} rows exceed capacity "
                            f"{cache.capacity}", "build the FastDrafter with a larger capacity")
        bucket = self._stage_append(pending, cache)
        if bucket is None:
            self._append_eager(pending, cache)
        elif cache.graphs is not None:
            cache.graphs.appends[bucket].replay()
        else:
            self._append_static(cache, bucket)
        cache.length += p

    def _stage_append(self, pending: torch.Tensor, cache: DraftContextCache) -> int | None:
        """Put p pending rows in the static staging rows (unless a walk already wrote them there,
        fast/commit.py) and set the count: the append bucket, or None (no static path fits)."""
        static = cache.static
        p = pending.shape[0]
        bucket = next((b for b in static.buckets if b >= p), None) if static else None
        if bucket is None:
            return None
        if not self.staged_in_place(pending, cache):
            static.feats[:p].copy_(pending)
        if static.count_set != p:
            static.count.fill_(p)
            static.count_set = p
        return bucket

    @staticmethod
    def staged_in_place(pending: torch.Tensor, cache: DraftContextCache) -> bool:
        """Whether pending is the first rows of the cache's staging buffer itself."""
        static = cache.static
        return (static is not None and pending.data_ptr() == static.feats.data_ptr()
                and pending.shape[0] <= static.feats.shape[0] and pending.is_contiguous())

    def _context_kv(self, i: int, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Layer i's keys (k_norm, RoPE) and values [n, kv_heads, d] of projected features [n, H]."""
        layer, joins = self.drafter.layers[i], self.joins[i]
        n = ctx.shape[0]
        k, v = self.linear(joins.kv, ctx).split(joins.split[1:], dim=-1)
        k = layer.self_attn.k_norm(k.reshape(n, self.num_kv_heads, self.head_dim))
        return _apply_rope(k, cos, sin), v.reshape(n, self.num_kv_heads, self.head_dim)

    def qkv(self, i: int, h: torch.Tensor):
        """Layer i's normed queries and keys (before RoPE) and values, [n, heads, d] each, of its
        normed input h [n, H], in one product."""
        joins, attn = self.joins[i], self.drafter.layers[i].self_attn
        n = h.shape[0]
        q, k, v = self.linear(joins.qkv, h).split(joins.split, dim=-1)
        q = attn.q_norm(q.reshape(n, self.num_heads, self.head_dim))
        k = attn.k_norm(k.reshape(n, self.num_kv_heads, self.head_dim))
        return q, k, v.reshape(n, self.num_kv_heads, self.head_dim)

    def mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Layer i's MLP of its normed input x [n, H], gate and up in one product."""
        mlp = self.drafter.layers[i].mlp
        gate, up = self.linear(self.joins[i].gate_up, x).chunk(2, dim=-1)
        return self.linear(mlp.down_proj, mlp.act(gate) * up)

    def _project(self, feats: torch.Tensor, positions: torch.Tensor):
        ctx = self.drafter.hidden_norm(self.linear(self.drafter.fc, feats.to(self.dtype)))
        cos, sin = self._rope(positions, ctx.dtype)
        return ctx, cos, sin

    def _append_eager(self, pending: torch.Tensor, cache: DraftContextCache) -> None:
        start, p = cache.length, pending.shape[0]
        positions = torch.arange(start, start + p, device=self.device)
        ctx, cos, sin = self._project(pending, positions)
        for i, layer in enumerate(self.drafter.layers):
            k, v = self._context_kv(i, ctx, cos, sin)
            cache.keys[i, :, start:start + p] = k.transpose(0, 1)
            cache.values[i, :, start:start + p] = v.transpose(0, 1)
        cache.length_t.fill_(start + p)

    def _append_static(self, cache: DraftContextCache, bucket: int) -> None:
        static = cache.static
        positions = cache.length_t + static.rows[:bucket]
        # Pad rows go past the new length; any that would run off the buffer share the scratch row.
        index = positions.clamp(max=cache.rows - 1)
        ctx, cos, sin = self._project(static.feats[:bucket], positions)
        for i, layer in enumerate(self.drafter.layers):
            k, v = self._context_kv(i, ctx, cos, sin)
            cache.keys[i].index_copy_(1, index, k.transpose(0, 1))
            cache.values[i].index_copy_(1, index, v.transpose(0, 1))
        cache.length_t.add_(static.count)

    # ---- the block forward -------------------------------------------------------------------
    @torch.no_grad()
    def block(self, bonus: int | torch.Tensor, start: int, cache: DraftContextCache) -> torch.Tensor:
        """Draft logits [B-1, V] float32 for positions start+1..start+B-1.

        bonus: a python int or a 1-element long device tensor (no host sync either way). On a
        cache with graphs the result is the graph's output buffer: read it before the next block
        call on the same cache.
        """
        static = cache.static
        if static is None:
            hidden = self._block_eager(self._block_ids(bonus), start, cache)
            return self.linear(self.lm_head, hidden[1:]).float()
        self.settle(cache)
        self._set_bonus(static, bonus)
        static.start.fill_(start)
        if cache.graphs is not None:
            cache.graphs.block.replay()
            return cache.graphs.block_out
        return self._block_static(cache)

    @torch.no_grad()
    def draft(self, bonus: int | torch.Tensor, start: int, pending: torch.Tensor,
              cache: DraftContextCache, depth: int) -> torch.Tensor:
        """append(pending) then block: draft logits [depth, V] float32 (depth <= B-1).

        pending holds the features of positions cache.length..start-1."""
        if not 0 <= depth < self.block_size:
            raise BadParams(f"draft depth {depth} outside 0..{self.block_size - 1} (the drafter's block)")
        static = cache.static
        p = int(pending.shape[0])
        if static is not None and static.ahead is not None:
            if static.ahead == (cache.length, p, bonus) and start == cache.length + p \
                    and self.staged_in_place(pending, cache):
                static.ahead = None  # this step already ran: its logits are in static.out
                cache.length += p
                return static.out[:depth]
            self.settle(cache)
        if static is not None and p > 0 and cache.length + p == start:
            if cache.length + p > cache.capacity:
                raise BadParams(f"drafter cache full: {cache.length} + {p} rows exceed capacity "
                                f"{cache.capacity}", "build the FastDrafter with a larger capacity")
            bucket = self._stage_append(pending, cache)
            if bucket is not None:  # the whole step in one replay: append, block at the new length
                self._set_bonus(static, bonus)
                if cache.graphs is not None:
                    cache.graphs.drafts[bucket].replay()
                else:  # the same code on a CPU (or before capture)
                    self._draft_static(cache, bucket)
                cache.length += p
                return static.out[:depth]
        self.append(pending, cache)
        if cache.static is None:  # eager: the head only reads the rows asked for
            hidden = self._block_eager(self._block_ids(bonus), start, cache)
            return self.linear(self.lm_head, hidden[1:1 + depth]).float()
        return self.block(bonus, start, cache)[:depth]

    def draft_ahead(self, cache: DraftContextCache, length: int) -> None:
        """Run the next draft step now, from what a walk wrote into this cache's inputs (the
        accepted features in the staging rows, their count, the bonus in ids[0]; commit.py),
        before the host knows how many rows that is: the widest append bucket, with `count` rows
        real. length: the context rows before them (the session's host length). The host then
        calls note_ahead with the count and bonus it read, and the next draft() with those takes
        the logits without running anything (anything else settles first)."""
        static = cache.static
        widest = static.buckets[-1]
        if cache.graphs is not None:
            cache.graphs.drafts[widest].replay()
        else:  # the same code on a CPU
            self._draft_static(cache, widest)
        static.ahead = (length, None, None)

    @staticmethod
    def note_ahead(cache: DraftContextCache, count: int, bonus: int) -> None:
        """What the last walk wrote into the drafter's inputs (and the draft run ahead on them)."""
        static = cache.static
        static.count_set, static.bonus_set = count, bonus
        if static.ahead is not None:
            static.ahead = (static.ahead[0], count, bonus)

    @staticmethod
    def settle(cache: DraftContextCache) -> None:
        """Drop a draft step run ahead that will not be used: its rows past the host length stay
        unread, and the device length goes back to the host's."""
        static = cache.static
        if static is not None and static.ahead is not None:
            static.ahead = None
            cache.length_t.fill_(cache.length)

    def _set_bonus(self, target: torch.Tensor | _StaticIO, bonus: int | torch.Tensor) -> None:
        """Write the bonus into ids[0] (target: the ids, or a static cache's inputs, where an int
        equal to what ids[0] already holds needs no fill)."""
        static = target if isinstance(target, _StaticIO) else None
        ids = static.ids if static is not None else target
        if isinstance(bonus, torch.Tensor):
            if bonus.numel() != 1:
                raise BadParams(f"bonus must be one token, got a tensor of shape {tuple(bonus.shape)}")
            ids[:1].copy_(bonus.reshape(1))
            if static is not None:
                static.bonus_set = None
        elif static is None or static.bonus_set != int(bonus):
            ids[:1].fill_(int(bonus))
            if static is not None:
                static.bonus_set = int(bonus)

    def _block_ids(self, bonus: int | torch.Tensor) -> torch.Tensor:
        ids = torch.full((self.block_size,), self.mask_token_id, dtype=torch.long, device=self.device)
        self._set_bonus(ids, bonus)
        return ids

    def _block_eager(self, ids: torch.Tensor, start: int, cache: DraftContextCache) -> torch.Tensor:
        length, b = cache.length, self.block_size
        positions = torch.arange(start, start + b, device=self.device)
        return self._block_layers(ids, positions, cache, slice(length, length + b), length + b, None)

    def compile(self) -> None:
        """Run the static block forward through torch.compile (it fuses the norms, RoPE and
        casts between the GEMMs); it compiles at the first static block, which capture's
        warm-up runs. Graph captures made before this call keep the uncompiled kernels."""
        if self._compiled_block is None:
            self._compiled_block = torch.compile(self._block_static_raw)

    def _block_static(self, cache: DraftContextCache, start: torch.Tensor | None = None) -> torch.Tensor:
        """start: the block's first position on the device (None: static.start)."""
        start = cache.static.start if start is None else start
        if self._compiled_block is not None and warming_up():  # graphs.py says why only then
            return self._compiled_block(cache, start)
        return self._block_static_raw(cache, start)

    def _draft_static(self, cache: DraftContextCache, bucket: int) -> torch.Tensor:
        """The whole draft step of a round: append `bucket` staged rows, then the block at the
        context's new length (a round's block starts where its context ends), into static.out."""
        self._append_static(cache, bucket)
        out = cache.static.out
        out.copy_(self._block_static(cache, cache.length_t))
        return out

    def _block_static_raw(self, cache: DraftContextCache, start: torch.Tensor) -> torch.Tensor:
        static, b = cache.static, self.block_size
        rows = static.rows[:b]
        index = cache.length_t + rows
        if self.attention == "triton":  # the kernel reads the length itself
            hidden = self._block_layers(static.ids, start + rows, cache, index, None, None, cache.length_t)
        else:
            visible = (static.cols < cache.length_t + b)[None, None, None, :]
            hidden = self._block_layers(static.ids, start + rows, cache, index, None, visible)
        return self.linear(self.lm_head, hidden[1:]).float()

    def _block_layers(self, ids: torch.Tensor, positions: torch.Tensor, cache: DraftContextCache,
                      rows: slice | torch.Tensor, kv_len: int | None,
                      mask: torch.Tensor | None, length: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden [B, H] after the final norm. The block's keys/values go to buffer `rows` (a
        slice, or an index tensor on the static path) before each layer attends over the first
        kv_len rows (None: the whole buffer under `mask`, or with `length`, the context length
        on the device, the triton kernel's rows [:length + B])."""
        b = ids.shape[0]
        x = self.embed(ids)
        cos, sin = self._rope(positions, x.dtype)
        for i, layer in enumerate(self.drafter.layers):
            attn = layer.self_attn
            q, k, v = self.qkv(i, layer.input_layernorm(x))
            q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
            keys, values = cache.keys[i], cache.values[i]
            if isinstance(rows, slice):
                keys[:, rows] = k.transpose(0, 1)
                values[:, rows] = v.transpose(0, 1)
                keys, values = keys[:, :kv_len], values[:, :kv_len]
            else:
                keys.index_copy_(1, rows, k.transpose(0, 1))
                values.index_copy_(1, rows, v.transpose(0, 1))
            x = x + self.linear(attn.o_proj, self._attend(q, keys, values, mask, length))
            x = x + self.mlp(i, layer.post_attention_layernorm(x))
        return self.drafter.norm(x)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                mask: torch.Tensor | None, length: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, heads, d]; keys/values [kv_heads, n, d] -> [B, heads * d]. With `length`
        (static path, triton kernel): the block's rows follow `length` context rows.

        Query head h reads kv head h // G (as repeat_interleave maps them), so the G query heads
        of one kv head become G*B query rows of that kv head."""
        b, kvh, g, d = q.shape[0], self.num_kv_heads, self.groups, self.head_dim
        if length is not None:
            out = fused.tree_attention(q, keys[None], values[None], length.view(1), None, self.scaling,
                                       keys.shape[1])
            return out.view(b, self.num_heads * d)
        folded = q.view(b, kvh, g, d).permute(1, 2, 0, 3).reshape(1, kvh, g * b, d)
        if self.eager_attention == "matmul":
            out = matmul_attention(folded[0], keys, values, self.scaling, None if mask is None else mask[0])
        else:
            out = F.scaled_dot_product_attention(folded, keys[None], values[None], attn_mask=mask,
                                                 scale=self.scaling)
        return out.view(kvh, g, b, d).permute(2, 0, 1, 3).reshape(b, self.num_heads * d)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [n, d] computed in float32, then cast, as DFlashDrafter.rope does."""
        freqs = positions[:, None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)
