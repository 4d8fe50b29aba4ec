"""FastTarget: the target side of the fast backend (our forward, a static KV cache, CUDA graphs).

It offers the surface decode.Session uses on target.Target, with the same semantics: a forward of
n tokens writes their K/V to cache rows [length, length+n) whatever the positions (positions only
drive RoPE), then length += n; new row i sees every old row and, among the new rows, those its
mask row allows (causal when there is no mask, a tree's ancestors for a verify).

Two code paths compute that:
- eager: shapes follow n; attention reads rows [:length+n] only. Prefill and anything larger than
  the largest bucket run here.
- static: n padded to a bucket q (1, 2, then a power of two plus one: bucket_sizes), K/V
  written with index_copy_ at length+arange(q),
  attention over the first kv rows (kv: the cache's smallest KV bucket >= length+q, cache.py) with
  a [q, kv] mask built on the device from `cache.length_t`. Nothing in it reads a device value on
  the host, so `capture` records it as one CUDA graph per (q, kv); on a CPU `static=True` runs it
  without graphs so its logic is testable. Padded rows land past the real ones (the cache's
  slack) and no later query sees them: a row becomes visible only once a real token has been
  written there. The graphs of one q share their input and output buffers (a `_Stage`).

After a static verify, `walk_commit` walks the tree on the device and gathers the accepted K/V
rows into place in one more graph (commit.py), then reads the round's one packed result.
"""

from __future__ import annotations

import bisect
import weakref
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch

from ddtree.engine.reference.errors import BadParams, DecodeError, ModelLoadError
from ddtree.engine.reference.fast.cache import ROW_ALIGN, StaticKVCache, kv_bucket, kv_buckets
from ddtree.engine.reference.fast.commit import new_walk_io, set_walk_inputs, walk_commit_static
from ddtree.engine.reference.fast.graphs import record_graph, warming_up
from ddtree.engine.reference.fast.model import (
    AttentionPlan,
    DenseDecoder,
    choose_attention,
    eager_kernel,
    fold_mask,
    load_decoder,
)
from ddtree.engine.reference.target import ForwardOut, HeadShapes

#: Query rows past which an eager forward after earlier rows attends with SDPA (see _eager).
LONG_BLOCK = 128
from ddtree.engine.reference.tree import Tree

DEFAULT_MAX_QUERY = 64
_WARMUP_RUNS = 2


def bucket_sizes(max_query: int) -> tuple[int, ...]:
    """1, 2, then powers of two plus one (3, 5, 9, 17, ...) up to the first >= max_query.

    A DDTree verify at budget B has B+1 nodes (the bonus and B drafts) and budgets are usually
    powers of two, so B+1 fits its bucket exactly; with plain powers of two budget 64 padded 65
    rows to 128, a near doubling of the verify once the GEMMs stop being weight-bound. A DFlash
    block of 16 (16 rows) pads one row to 17."""
    if not isinstance(max_query, int) or isinstance(max_query, bool) or max_query < 1:
        raise BadParams(f"max_query must be a positive integer, got {max_query!r}")
    sizes = [1]
    power = 1
    while sizes[-1] < max_query:
        sizes.append(power + 1)
        power *= 2
    return tuple(sizes)


@dataclass
class _Stage:
    """One query bucket's static buffers, shared by its graphs of every KV bucket (and the walk)."""
    ids: torch.Tensor                 # [q] long (input)
    positions: torch.Tensor           # [q] long (input)
    tree: torch.Tensor                # [q, q] bool (input): visibility among the new rows
    logits: torch.Tensor              # [q, V] float32 (output)
    features: torch.Tensor | None     # [q, K*H] (output)
    n_set: int | None = None          # the n whose visibility `tree` holds (None: unknown)


@dataclass
class _Verify:
    """The last static forward on a cache, for walk_commit (the cache is held weakly)."""
    cache: weakref.ref
    stage: _Stage
    q: int
    n: int
    start: int


class FastTarget(HeadShapes):
    """A DenseDecoder called the way the decoders need it (the surface of target.Target)."""

    def __init__(self, model: DenseDecoder, feature_layers: tuple[int, ...] = (), *,
                 context_window: int | None = None, max_query: int = DEFAULT_MAX_QUERY,
                 static: bool = False, attention: str = "auto") -> None:
        """context_window: rows a cache holds for the context (default max_position_embeddings).
        max_query: the most tokens a forward after the prefill adds (budget + 1); the buckets
        go up to the first bucket >= it and every cache gets that many rows of slack.
        static: run forwards that fit a bucket on the static padded path even without graphs.
        attention: "sdpa", "matmul", "triton" (model.py says when each wins) or "auto"
        (model.choose_attention: triton on CUDA where triton is installed, else matmul on CUDA
        where torch has float32-output GEMMs for half inputs, else sdpa). Triton's kernel serves
        the static path; eager forwards take model.eager_kernel. A causal prefill on an empty
        cache always takes SDPA (flash attention).
        """
        cfg = model.cfg
        model.fuse()
        self.model = model.eval()
        self.cfg = cfg
        self.config = model.config if model.config is not None else SimpleNamespace(
            model_type=cfg.model_type, num_hidden_layers=cfg.num_hidden_layers,
            max_position_embeddings=cfg.max_position_embeddings, hidden_size=cfg.hidden_size,
            vocab_size=cfg.vocab_size)
        self.feature_layers = tuple(int(i) for i in feature_layers)
        self.num_layers = cfg.num_hidden_layers
        bad = [i for i in self.feature_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ModelLoadError(f"feature layers {bad} outside the target's {self.num_layers} layers",
                                 "pair the drafter with the target it was trained for")
        weight = model.model.embed_tokens.weight
        self.device = weight.device
        self.dtype = weight.dtype
        self.embed = model.model.embed_tokens
        self.lm_head = model.lm_head
        cw = context_window if context_window is not None else cfg.max_position_embeddings
        if not isinstance(cw, int) or isinstance(cw, bool) or cw < 1:
            raise BadParams(f"context_window must be a positive integer, got {cw!r}")
        self.context_window = cw
        self.buckets = bucket_sizes(max_query)
        self.static = bool(static)
        self.compiled = False  # static forwards run torch.compile'd layers (see compile())
        # The static path without graphs attends over the smallest KV bucket that holds the
        # context, as the graphs do; False reads every row (what tests compare it against).
        self.bucket_kv = True
        qmax = self.buckets[-1]
        self._eye = torch.eye(qmax, dtype=torch.bool, device=self.device)
        self._tril = torch.ones(qmax, qmax, dtype=torch.bool, device=self.device).tril()
        self._arange = torch.arange(qmax, device=self.device)
        self._groups = cfg.num_attention_heads // cfg.num_key_value_heads
        self.attention = choose_attention(attention, self.device, cfg.head_dim)
        self.eager_attention = eager_kernel(self.attention, self.device)
        self._graph_pool = None  # one CUDA graph memory pool for every cache's graphs
        self._last: _Verify | None = None
        # (sink, count) after a walk that staged the accepted features in a drafter's rows.
        self.staged: tuple[torch.Tensor, int] | None = None
        self.wrote_next = False  # whether the last walk_commit wrote the drafter's next inputs
        self._pinned: dict[int, torch.Tensor] = {}  # walk results read back (_read_packed)
        self._read_done = torch.cuda.Event() if self.device.type == "cuda" else None
        model.rope(self._arange[:1], self.dtype)  # moves the RoPE table to the device now, not in a capture

    def new_cache_rows(self) -> int:
        """The rows new_cache allocates (the window, the largest bucket's slack, aligned)."""
        return -(-(self.context_window + self.buckets[-1]) // ROW_ALIGN) * ROW_ALIGN

    def new_cache(self) -> StaticKVCache:
        cfg = self.cfg
        return StaticKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                             self.context_window, slack=self.buckets[-1], device=self.device,
                             dtype=self.dtype)

    @staticmethod
    def tree_mask(tree: Tree, start: int = 0) -> torch.Tensor | None:
        """What forward takes for a tree verify: its ancestor matrix [n, n] bool, None for a chain.

        `start` (the context length) is not needed: the context is always fully visible.
        """
        return None if tree.is_chain else tree.ancestors()

    # ---- forward ----------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: StaticKVCache,
                attention_mask: torch.Tensor | None = None, *, features: bool = False,
                last_only: bool = False, copy: bool = True) -> ForwardOut:
        """input_ids/position_ids [n] -> logits float32 [n, V] ([1, V] with last_only).

        attention_mask: None (causal among the new rows) or bool [n, n], True where new row i sees
        new row j. An additive mask [1, 1, n, length+n] (tree.tree_attention_mask) is read too.
        features: concat of feature_layers' outputs [n, K*H] in the model dtype.
        copy=False: a static forward returns views of its stage's buffers, which the next forward
        on this cache overwrites (a round that reads them first saves a clone of [q, V]).
        """
        n = int(input_ids.shape[0])
        if n < 1 or input_ids.dim() != 1 or tuple(position_ids.shape) != (n,):
            raise BadParams(f"forward takes input_ids and position_ids of one shape [n], got "
                            f"{tuple(input_ids.shape)} and {tuple(position_ids.shape)}")
        visible = self._visible(attention_mask, n, cache.length)
        start = cache.length
        cache.moved = None
        self._last = None
        self.staged = None
        found = self._graph_for(cache, n)
        if found is not None:
            q, graph = found
            stage = cache.stages[q]
            self._stage(stage, input_ids, position_ids, visible)
            graph.replay()
        elif self.static and n <= self.buckets[-1] and start + self._bucket(n) <= cache.rows:
            q = self._bucket(n)
            stage = self._stage_for(cache, q)
            self._stage(stage, input_ids, position_ids, visible)
            span = kv_bucket(cache.rows, start + q) if self.bucket_kv else cache.rows
            self.static_forward(stage.ids, stage.positions, stage.tree, cache, span, stage)
        else:
            return self._eager(input_ids, position_ids, visible, cache, features, last_only)
        return self._static_out(cache, stage, q, n, start, features, last_only, copy)

    def stage_tree(self, cache: StaticKVCache, tree: Tree) -> int | None:
        """Write a tree verify's inputs straight into the stage of its query bucket: ids,
        positions (depths after the device length), visibility, and the walk's parents. Graph-
        ready (FastPath captures it with the tree build), so a verify after it copies nothing in
        (forward_staged). The bucket q, or None where the cache has no stage or walk for it."""
        n = tree.size
        q = next((b for b in self.buckets if b >= n), None)
        stage = cache.stages.get(q) if q is not None else None
        io = cache.walks.get(q) if q is not None else None
        if stage is None or io is None:
            return None
        stage.ids[:n].copy_(tree.tokens)
        stage.positions[:n].copy_(tree.depths + cache.length_t)
        stage.tree.copy_(self._eye[:q, :q])
        stage.tree[:n, :n].copy_(tree.ancestors())
        io.parents[:n].copy_(tree.parents)
        return q

    def forward_staged(self, cache: StaticKVCache, n: int, q: int) -> ForwardOut | None:
        """The verify of n nodes whose inputs stage_tree wrote into bucket q's stage: replay (or
        the static path on a CPU) with nothing copied in. None where bucket q does not serve it
        now (the caller then runs forward, which stages the inputs itself). Its logits and
        features are views of the stage, as forward's with copy=False."""
        start = cache.length
        cache.moved = None
        self._last = None
        self.staged = None
        stage = cache.stages.get(q)
        found = self._graph_for(cache, n)
        if stage is None:
            return None
        if found is not None:
            if found[0] != q:
                return None
            found[1].replay()
        elif (not cache.graphs and self.static and self._bucket(n) == q and start + q <= cache.rows):
            span = kv_bucket(cache.rows, start + q) if self.bucket_kv else cache.rows
            self.static_forward(stage.ids, stage.positions, stage.tree, cache, span, stage)
        else:
            return None
        stage.n_set = n  # stage_tree left the padded rows' identity for this n
        return self._static_out(cache, stage, q, n, start, True, False, False)

    def step_one(self, cache: StaticKVCache, token: int | torch.Tensor) -> _Stage | None:
        """One row at the cache's length, on the static path (its graph, or on a CPU the code
        the graph captures): the token an int, or a [1] long device tensor read in place (no
        host copy, so it may be the argmax of a step the host has not read yet). Its logits are
        the returned stage's logits[0]. It leaves cache.length alone (the caller books the row
        once it takes it: fast/step_ahead.py). None where no static path serves it."""
        start = cache.length
        found = self._graph_for(cache, 1)
        if found is not None:
            q, graph = found
            stage = cache.stages[q]
        elif not cache.graphs and self.static and start + self._bucket(1) <= cache.rows:
            q, graph = self._bucket(1), None
            stage = self._stage_for(cache, q)
        else:
            return None
        cache.moved = None
        self._last = None
        self.staged = None
        if isinstance(token, int):
            stage.ids[:1].fill_(token)
        else:
            stage.ids[:1].copy_(token)
        stage.positions[:1].fill_(start)
        if stage.n_set != 1:
            stage.tree.copy_(self._eye[:q, :q])
            stage.n_set = 1
        if graph is not None:
            graph.replay()
        else:
            span = kv_bucket(cache.rows, start + q) if self.bucket_kv else cache.rows
            self.static_forward(stage.ids, stage.positions, stage.tree, cache, span, stage)
        return stage

    def _static_out(self, cache: StaticKVCache, stage: _Stage, q: int, n: int, start: int,
                    features: bool, last_only: bool, copy: bool) -> ForwardOut:
        logits, feats = stage.logits, stage.features
        self._last = _Verify(weakref.ref(cache), stage, q, n, start)
        cache.set_length(start + n)
        logits = logits[n - 1:n] if last_only else logits[:n]
        feats = feats[:n] if features and feats is not None else None
        # Graph outputs are overwritten by the next replay; callers may keep what we return
        # unless copy is off (a prefill's features are kept across forwards: always copied).
        copy = copy or last_only
        return ForwardOut(logits=logits.clone() if copy else logits,
                          features=self._features(feats, n, features, copy))

    def _features(self, feats, n: int, wanted: bool, copy: bool):
        if not wanted:
            return None
        if feats is None:  # no feature layers: an empty block, as torch.cat of nothing would mean
            return torch.zeros((n, 0), dtype=self.dtype, device=self.device)
        return feats.clone() if copy else feats

    def _visible(self, mask: torch.Tensor | None, n: int, start: int) -> torch.Tensor | None:
        if mask is None:
            return None
        if mask.dtype == torch.bool and tuple(mask.shape) == (n, n):
            return mask
        if mask.is_floating_point() and mask.dim() == 4 and tuple(mask.shape[-2:]) == (n, start + n):
            return mask[0, 0, :, start:] == 0
        raise BadParams(f"attention_mask must be bool [{n}, {n}] (or additive [1, 1, {n}, {start + n}]), "
                        f"got {mask.dtype} {tuple(mask.shape)}")

    def _eager(self, ids, positions, visible, cache: StaticKVCache, features: bool,
               last_only: bool) -> ForwardOut:
        n, start = int(ids.shape[0]), cache.length
        end = start + n
        if end > cache.rows:
            raise DecodeError(f"KV cache full: {start} rows + {n} new > {cache.rows}",
                              f"the context window is {self.context_window} tokens")
        if visible is None and start == 0:
            plan = AttentionPlan(slice(0, n), n, None, fresh=True)
        elif n == 1:
            plan = AttentionPlan(slice(start, end), end, None, kernel=self.eager_attention)
        else:
            block = visible
            if block is None:
                block = torch.ones((n, n), dtype=torch.bool, device=self.device).tril()
            seen = torch.ones((n, end), dtype=torch.bool, device=self.device)
            seen[:, start:] = block
            # A long block after earlier rows (a prefill chunk) takes SDPA, whose fused kernels
            # never hold the float32 scores [kv_heads, groups*n, S] the matmul kernel builds:
            # gigabytes a layer for a 2048-token chunk deep into a long context.
            kernel = "sdpa" if n > LONG_BLOCK else self.eager_attention
            plan = AttentionPlan(slice(start, end), end, self._fold(seen, kernel), kernel=kernel)
        layers = self.feature_layers if features else ()
        hidden, feats = self.model(ids, positions, cache.k, cache.v, plan, layers)
        if last_only:
            hidden = hidden[-1:]
        logits = self.lm_head(hidden).float()
        cache.set_length(end)
        return ForwardOut(logits=logits, features=self._features(feats, n, features, False))

    def static_forward(self, ids: torch.Tensor, positions: torch.Tensor, tree: torch.Tensor,
                       cache: StaticKVCache, kv: int | None = None,
                       into: _Stage | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The graph-ready forward: ids/positions [q], tree bool [q, q] -> logits [q, V], features.

        Every shape depends on q, kv and the cache only; the context length is read on the device.
        It writes K/V rows length+arange(q) and leaves cache.length alone (the caller adds n).
        kv: attend over rows [:kv] (None: all rows); it must hold length+q, which the caller picks
        it for (a graph replays only where that holds). into: write the logits and features into
        this stage's buffers (what the graphs of one query bucket share) and return them.
        """
        q = int(ids.shape[0])
        span = cache.rows if kv is None else int(kv)
        length = cache.length_t
        rows = length + self._arange[:q]
        if self.attention == "triton":  # sized for the whole cache: one compiled layer for every span
            plan = AttentionPlan(rows, cache.rows, None, kernel="triton", lengths=length.view(1), tree=tree[None])
        else:
            rel = torch.arange(span, device=cache.device) - length          # [S]: column - length
            among_new = (rel >= 0) & (rel < q)
            tree_cols = tree.index_select(1, rel.clamp(0, q - 1))           # [q, S]
            seen = (rel < 0)[None, :] | (among_new[None, :] & tree_cols)
            plan = AttentionPlan(rows, span, self._fold(seen), kernel=self.attention)
        hidden, feats = self.model(ids, positions, cache.k, cache.v, plan, self.feature_layers,
                                   compiled=self.compiled and warming_up())
        weight, bias, gemv = self.lm_head.weight, self.lm_head.bias, self.model.gemv
        if into is None:
            return gemv(hidden, weight, bias).float(), feats
        if weight.dtype == torch.float32 and bias is None and not gemv.takes(hidden, weight):
            torch.mm(hidden, weight.t(), out=into.logits)  # straight into the shared buffer
        else:
            into.logits.copy_(gemv(hidden, weight, bias))  # the cast to float32 is this copy
        if into.features is not None and feats is not None:
            into.features.copy_(feats)
        return into.logits, into.features

    def _fold(self, seen: torch.Tensor, kernel: str | None = None) -> torch.Tensor:
        mask_dtype = torch.float32 if (kernel or self.attention) == "matmul" else self.dtype
        return fold_mask(seen, self._groups, mask_dtype)

    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _stage_for(self, cache: StaticKVCache, q: int) -> _Stage:
        """The cache's buffers for query bucket q (made on first use)."""
        stage = cache.stages.get(q)
        if stage is None:
            width = len(self.feature_layers) * self.hidden_size
            stage = _Stage(ids=torch.zeros(q, dtype=torch.long, device=self.device),
                           positions=torch.zeros(q, dtype=torch.long, device=self.device),
                           tree=self._eye[:q, :q].clone(),
                           logits=torch.zeros((q, self.vocab_size), dtype=torch.float32, device=self.device),
                           features=(torch.zeros((q, width), dtype=self.dtype, device=self.device)
                                     if width else None))
            cache.stages[q] = stage
        return stage

    def _stage(self, stage: _Stage, ids, positions, visible) -> None:
        """Write n real rows into a bucket's static buffers; padded rows see only themselves."""
        n, q = int(ids.shape[0]), int(stage.ids.shape[0])
        stage.ids[:n].copy_(ids)
        stage.positions[:n].copy_(positions)
        # Padded ids/positions keep whatever valid values they held: nobody reads their outputs.
        if stage.n_set != n:  # the padded rows' identity is still there when n is the same
            stage.tree.copy_(self._eye[:q, :q])
            stage.n_set = n
        stage.tree[:n, :n].copy_(visible if visible is not None else self._tril[:n, :n])

    # ---- CUDA graphs ------------------------------------------------------------------------
    def _graph_for(self, cache: StaticKVCache, n: int):
        """(q, graph): the smallest captured query bucket >= n that fits, at the smallest KV
        bucket that holds the context and its q rows; None when nothing captured fits."""
        if not cache.graphs:
            return None
        start = cache.length
        for q in self.buckets:  # ascending; a lookup per round, so no scan over every graph
            if q < n:
                continue
            if start + q > cache.rows:
                return None
            spans = cache.spans.get(q)
            if spans:
                at = bisect.bisect_left(spans, start + q)
                if at < len(spans):
                    return q, cache.graphs[(q, spans[at])]
        return None

    def take_verify(self, n: int) -> _Verify | None:
        """The last forward's record if it ran on the static path with n rows (else None); once."""
        last, self._last = self._last, None
        if last is None or last.n != n or last.cache() is None:
            return None
        return last

    @torch.no_grad()
    def walk_commit(self, last: _Verify, parents: torch.Tensor, posterior: torch.Tensor | None,
                    greedy: bool = False, copy: bool = True,
                    then: Callable[[], None] | None = None) -> tuple[torch.Tensor, list[int], list[int]]:
        """The walk and commit of a static verify: (path, path_list, new_tokens) as fetch_walk.

        parents [n] and posterior [n] long: the tree's parents (None: stage_tree wrote them) and
        the target's choice at each node; greedy=True takes the argmax of the verify's logits inside the walk instead
        (posterior may then be None). One graph (or on a CPU the same code) walks the tree held
        in the stage, gathers the accepted K/V rows to start.. and packs count, order and tokens;
        one transfer reads them. The cache then skips the row move in compact(start, path,
        path_list). Where the cache has a feature sink (a drafter's staging rows), the accepted
        features land there too and `staged` says so; where it has the drafter's inputs too
        (draft_next), `wrote_next` says the walk wrote them.

        then: work to queue on the device after the walk and before the host waits for it (the
        next round's draft step, backend.FastPath): the packed result comes back through a
        pinned buffer and an event, so the host does not wait for that work too.
        """
        cache, stage, q, n = last.cache(), last.stage, last.q, last.n
        io = cache.walks.get(q)
        if io is None:
            io = cache.walks[q] = new_walk_io(q, self.device)
        if not greedy:
            io.posterior[:n].copy_(posterior)
        if parents is not None:  # None: stage_tree already wrote them
            io.parents[:n].copy_(parents)
        set_walk_inputs(io, n, greedy)
        if io.graph is not None:
            io.graph.replay()
            sink, draft_next = io.sink, io.draft_next
        else:
            sink, draft_next = cache.sink, cache.draft_next
            walk_commit_static(stage.ids, stage.tree, io, cache, stage.logits, stage.features, sink, draft_next)
        packed = self._read_packed(io.packed, then if draft_next is not None else None)  # the round's one sync
        c = packed[0]
        self.wrote_next = draft_next is not None
        cache.moved = (last.start, c)
        self.staged = (sink, c) if sink is not None and stage.features is not None else None
        path = io.packed[1:1 + c]
        if copy:  # the buffer is rewritten by the next walk (copy=False: a round reads it first)
            path = path.clone()
        return path, packed[1:1 + c], packed[1 + q:1 + q + c]

    def _read_packed(self, packed: torch.Tensor, then: Callable[[], None] | None) -> list[int]:
        """packed as a list, with `then` queued after it on the device and not waited for."""
        if then is None:
            return packed.tolist()
        if packed.device.type != "cuda":
            out = packed.tolist()
            then()
            return out
        n = int(packed.shape[0])
        host = self._pinned.get(n)
        if host is None:
            host = self._pinned[n] = torch.empty(n, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        self._read_done.record(torch.cuda.current_stream(packed.device))  # where the copy runs
        then()
        self._read_done.synchronize()
        return host.tolist()

    def accepted_features(self, features: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
        """The features of the accepted rows [c, W]: the sink's rows where the last walk staged
        them there (no copy), else gathered from the verify's features."""
        staged, self.staged = self.staged, None
        if staged is not None and staged[1] == int(path.shape[0]):
            return staged[0][:staged[1]]
        return features.index_select(0, path)

    def compile(self) -> None:
        """Run the static path's layers through torch.compile (fuses the small elementwise ops a
        graph replay is otherwise bound by); compiles happen at the first forward of each shape,
        which capture's warm-up runs, so serving never waits for one.

        Every (query bucket, KV span) that capture records may compile its own variant of the
        layer (a span equal to the whole cache, or a one-row query, specialises differently), so
        dynamo's per-function recompile limit (8 by default) is raised to cover all of them;
        past the limit it would run the layer uncompiled inside the graphs of the extra spans.
        """
        spans = len(kv_buckets(self.new_cache_rows()))
        wanted = len(self.buckets) * (spans + 1) + 8
        config = torch._dynamo.config
        for name in ("recompile_limit", "cache_size_limit"):  # the older torch name
            if hasattr(config, name) and getattr(config, name) < wanted:
                setattr(config, name, wanted)
        if getattr(config, "accumulated_recompile_limit", wanted) < wanted:
            config.accumulated_recompile_limit = wanted
        self.model.compile_layers()
        self.compiled = True

    def kv_spans(self, rows: int) -> tuple[int, ...]:
        """The KV spans worth a graph each in a cache of `rows` rows: the KV buckets, or with the
        triton kernel, which reads only the rows the context has whatever the span, all rows."""
        return (rows,) if self.attention == "triton" else kv_buckets(rows)

    def capture(self, cache: StaticKVCache, buckets: tuple[int, ...] | None = None,
                spans: tuple[int, ...] | None = None, walks: bool = True) -> None:
        """Capture this cache's graphs (they bake in its buffers' addresses): a forward for each
        query bucket q and each KV bucket kv >= q (spans: default self.kv_spans(cache.rows)), and
        with walks a walk+commit per query bucket (walk_commit).

        Afterwards forward replays the smallest captured q >= n at the smallest kv that holds
        the context. Capturing writes padding K/V rows past cache.length (never visible) and
        leaves the length alone, so it may run on a fresh cache or between rounds. All graphs of
        this target (every cache's) share one memory pool: replays run one at a time on one
        stream, the outputs live in each query bucket's stage, allocated outside the pool, and
        forward copies them out before any other replay.
        """
        if self.device.type != "cuda":
            raise BadParams("CUDA graphs need the target on a CUDA device",
                            "on a CPU, FastTarget(static=True) runs the same static path")
        sizes = sorted({int(b) for b in (buckets if buckets is not None else self.buckets)})
        if not sizes or sizes[0] < 1 or sizes[-1] > self.buckets[-1]:
            raise BadParams(f"buckets {sizes} must lie in 1..{self.buckets[-1]} (max_query's bucket)")
        if cache.length + sizes[-1] > cache.rows:
            raise DecodeError(f"no room to capture: {cache.length} rows + bucket {sizes[-1]} > {cache.rows}")
        lengths = sorted({int(kv) for kv in (spans if spans is not None else self.kv_spans(cache.rows))}
                         | {cache.rows})
        if lengths[0] < 1 or lengths[-1] > cache.rows:
            raise BadParams(f"KV spans {lengths} must lie in 1..{cache.rows} (the cache's rows)")
        # In place: objects from cache.share() hold these same dicts.
        cache.graphs.clear()
        cache.spans.clear()
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        pool = self._graph_pool
        graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        with torch.inference_mode():
            for q in reversed(sizes):  # largest first: smaller captures reuse its freed blocks
                stage = self._stage_for(cache, q)
                first = True
                for kv in reversed([kv for kv in lengths if kv >= q]):
                    def run(kv=kv, stage=stage):
                        return self.static_forward(stage.ids, stage.positions, stage.tree, cache, kv, stage)
                    # Warm up on a side stream (lazy kernel, cuBLAS and compile work stays out of
                    # the graph), as torch.cuda.graph's documentation asks; once the first span
                    # of a bucket has warmed up, one run is enough for the others.
                    graphs[(q, kv)] = record_graph(run, pool, self.device, _WARMUP_RUNS if first else 1)[0]
                    first = False
                if walks:
                    io = cache.walks.get(q)
                    if io is None:
                        io = cache.walks[q] = new_walk_io(q, self.device)
                    # The walk's row gather reads and writes rows [length, length+q): padding rows.
                    io.count.fill_(0)  # no real nodes: start = length, every moved row is padding
                    io.count_set = None
                    io.graph = None
                    io.sink = cache.sink  # what this graph writes the accepted features to
                    io.draft_next = cache.draft_next

                    def walk(stage=stage, io=io):
                        walk_commit_static(stage.ids, stage.tree, io, cache, stage.logits, stage.features, io.sink,
                                           io.draft_next)
                    io.graph = record_graph(walk, pool, self.device, _WARMUP_RUNS)[0]
        torch.cuda.synchronize(self.device)
        for q, kv in sorted(graphs):
            cache.spans.setdefault(q, []).append(kv)
        cache.graphs.update(graphs)


def load_fast_target(directory: str | Path, *, device: str | torch.device = "cpu",
                     dtype: torch.dtype | str | None = None, feature_layers: tuple[int, ...] = (),
                     context_window: int | None = None, max_query: int = DEFAULT_MAX_QUERY,
                     static: bool = False) -> FastTarget:
    """Load a dense decoder checkpoint (config.json + safetensors) as a FastTarget.

    dtype None or "auto": float32 on a CPU, bfloat16 on CUDA (loading.resolve_dtype).
    """
    from ddtree.engine.reference.loading import resolve_dtype

    torch_dtype = resolve_dtype(dtype, str(device))
    model = load_decoder(directory, device=device, dtype=torch_dtype)
    return FastTarget(model, feature_layers, context_window=context_window, max_query=max_query,
                      static=static)
