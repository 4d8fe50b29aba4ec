"""The fast backend as decode.Session sees it (the surface of backends.TransformersPath).

Caches are preallocated per session slot. On CUDA, `warmup` captures each slot's graphs once
(target verify buckets at each KV span, the walk+commit, drafter block and appends); a session
takes a free slot and gives it back when it ends, so nothing is allocated or captured per
request. A session gets its own cache objects over the slot's buffers (StaticKVCache.share), so
one dropped without close() gives its slot back when it is garbage-collected (weakref.finalize).
Sessions beyond the slots get caches of their own and run the same code eagerly. Trees are built
and walked on the device; a round brings one packed tensor to the host (the accepted length, path
and tokens), and after a static verify the walk also moves the accepted K/V rows (commit.py).

On a slot each graph writes what the next one reads, where it reads it, so a round is four
replays and a few fills (fast/probe.HostWork counts them): the draft step (append + block) writes
its logits where the slot's tree (or chain) graph reads them; that graph writes the verify's
inputs and the walk's parents into the target's stage (FastTarget.stage_tree); the walk takes
the greedy argmax itself and writes the accepted features, their count and the bonus into the
drafter's inputs. So the next round's draft step needs nothing from the host, and a session
stepping alone has it replayed right after the walk, before the host waits for the walk's result
(walk_logits, draft ahead): the GPU drafts while the host books the round and comes back.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from ddtree.engine.reference.errors import ModelLoadError
from ddtree.engine.reference.fast.draft import FastDrafter
from ddtree.engine.reference.fast.graphs import record_graph, warmup_scope
from ddtree.engine.reference.fast.model import DecoderConfig, DenseDecoder, unsupported_reason
from ddtree.engine.reference.fast.step_ahead import StepAhead
from ddtree.engine.reference.fast.target import FastTarget
from ddtree.engine.reference.tree import Tree, build_tree_device, fetch_walk, walk_device

if TYPE_CHECKING:
    from ddtree.engine.reference.drafter import DFlashDrafter
    from ddtree.engine.reference.engine import Engine

DEFAULT_SLOTS = 4
CHAIN = -1  # the budget under which a DFlash chain's graph is kept (FastPath._trees)


def decoder_from_hf(model: nn.Module) -> DenseDecoder:
    """Our DenseDecoder over a transformers model's own parameters (shared, not copied)."""
    raw = model.config.to_dict()
    reason = unsupported_reason(raw)
    if reason:
        raise ModelLoadError(f"the fast backend cannot run this target: {reason}", "use --backend transformers")
    with torch.device("meta"):
        decoder = DenseDecoder(DecoderConfig.from_dict(raw), SimpleNamespace(**raw))
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("rotary_emb.inv_freq")}
    if decoder.cfg.tie_word_embeddings:
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    decoder.load_state_dict(state, strict=True, assign=True)
    decoder.tie_weights()
    weight = state["model.embed_tokens.weight"]
    decoder._inv_freq = decoder._inv_freq.to(weight.device)
    return decoder.eval().requires_grad_(False)


class FastPath:
    name = "fast"

    def __init__(self, engine: Engine, target: FastTarget, drafter: DFlashDrafter | None, *,
                 slots: int = DEFAULT_SLOTS, graphs: bool = True, compile: bool = True,
                 pool_slots: int = 0, pool_bytes: int | None = None) -> None:
        """slots: sessions with captured CUDA graphs; pool_slots: sessions whose K/V live in one
        KV pool (fast/pool.py) that batched rounds read in place (0: no pool, a cache per
        session), or as many as pool_bytes hold when that is fewer. With a pool, the graph
        slots are its first slots."""
        self.engine = engine
        self.target = target
        self.drafts = None
        if drafter is not None:
            self.drafts = FastDrafter(drafter, target.embed, target.lm_head,
                                      capacity=target.context_window, mask_token_id=engine.mask_token_id,
                                      attention=target.attention)
        self.slots = int(slots)
        self.want_graphs = bool(graphs) and target.device.type == "cuda"
        self.want_compile = bool(compile) and self.want_graphs
        self.graphs = False
        self.compile_error: str | None = None
        self._free: list[tuple] = []       # slots (target cache, draft cache) no session holds
        self._slots: list[tuple] = []
        # id(a session's target cache) -> the finalizer that gives its slot back (once).
        self._leases: dict[int, weakref.finalize] = {}
        # (budget, depth, source) -> a captured tree build: dozens of small kernels, about 4 ms
        # launched one by one on an H200 and 0.6 ms as one graph replay. source 0: the graph
        # reads its own input buffers (filled per round); else the data_ptr of a slot's draft
        # output, which the graph reads in place, with the bonus from the drafter's ids[0].
        self._trees: dict[tuple[int, int, int], _TreeGraph] = {}
        # data_ptr of a slot's draft output [B-1, V] -> (that output, the drafter's ids [B], the
        # slot's target cache, whose verify stage the tree build fills: stage_tree).
        self._sources: dict[int, tuple[torch.Tensor, torch.Tensor, object]] = {}
        # (tree tokens, query bucket, stage) of the last tree whose verify inputs are staged,
        # and the tokens of the last verify whose walk parents are: checked by identity, once.
        self._staged_tree: tuple | None = None
        self._parents_staged: torch.Tensor | None = None
        self._pool = None
        self.pool = None
        # Queue a lone session's next draft step before reading its walk (walk_logits); off
        # only to measure what it saves (bench/profile_round.py --draft-ahead).
        self.draft_ahead = True
        # A graphed round on the pool queues the next one before the host reads it
        # (fast/batch_graph.py); off with the server's --disable-overlap-schedule.
        self.round_ahead = True
        self.joining: set[int] = set()  # id() of sessions prefilled since the last pool round (fast/batch.py)
        # A lone greedy AR session's next step, queued before its token is read (same switch).
        self.steps = StepAhead(target)
        # Homogeneous greedy rounds on the pool run as one graph per shape on CUDA
        # (fast/batch_graph.py); batch_static runs that code without graphs (tests, on a CPU).
        self.batch_static = False
        self._round_stage = None
        self._prefill_stage = None
        self._usage: dict | None = None
        if pool_slots:
            from ddtree.engine.reference.fast.pool import KVPool, slot_bytes, slots_for

            wanted = int(pool_slots)
            if pool_bytes is not None:
                fits = slots_for(pool_bytes, target, self.drafts)
                if fits < 1:
                    per = slot_bytes(target, self.drafts)
                    raise ModelLoadError(
                        f"a KV pool of {pool_bytes / 2**30:.2f} GiB holds no session: one takes "
                        f"{per / 2**30:.2f} GiB at a {target.context_window}-token context window",
                        "raise --kv-pool-gb or lower --context-window")
                wanted = min(wanted, fits)
            self.slots = min(self.slots, wanted)
            self.pool = KVPool(target, self.drafts, wanted)
            self.refresh_usage()
            if not self.want_graphs:
                for i in range(self.pool.slots):
                    self.add_slot(self.pool.caches[i], self.pool.draft_caches[i] if self.drafts else None)

    def warmup(self, progress: Callable[[str], None] | None = None, budgets: tuple[int, ...] = ()) -> None:
        """Allocate the slots and, on CUDA, capture their graphs (once; later calls do nothing),
        and the tree builds of these budgets at every draft depth (other budgets are captured on
        their first round). Compiled code runs only in here (graphs.warmup_scope)."""
        with warmup_scope():
            self._warmup(progress, budgets)

    def _warmup(self, progress: Callable[[str], None] | None, budgets: tuple[int, ...]) -> None:
        if not self.want_graphs:
            return
        say = progress or (lambda _msg: None)
        depth = self.engine.block_size - 1
        if self.drafts is not None:
            for budget in budgets:
                if budget > 0:
                    for key in [0, *self._sources]:
                        self._tree_graphs(int(budget), depth, key)
                    say(f"captured the DDTree build for budget {budget} at draft depths 1..{depth}")
        if self._slots:
            return
        # The one place the tune runs: before the compile trace and the captures read its choices.
        say("timing the target's one-row and few-row products: cuBLAS against the GEMV kernels' tilings")
        gemv = self.target.model.gemv
        self.target.model.tune_gemv(rows=self.target.buckets)
        say(f"one-row products on the GEMV kernel: {', '.join(f'{n}x{k}' for n, k in sorted(gemv.picked)) or 'none'}")
        if gemv.measured_rows:
            counts = sorted({m for m, _, _ in gemv.picked_rows})
            say(f"few-row products on the kernel: {len(gemv.picked_rows)} of {len(gemv.measured_rows)} "
                f"(rows, shape) pairs, at rows {counts or 'none'}")
        if self.want_compile:
            say("compiling the decoder layer (torch.compile, once for every layer) and the drafter block")
            self.target.compile()
            if self.drafts is not None:
                self.drafts.compile()
        for i in range(self.slots):
            cache = self.pool.caches[i] if self.pool is not None else self.target.new_cache()
            # The drafter's graphs first: the target's walk graphs write the accepted features
            # straight into its staging rows (the sink), so those must exist before they are captured.
            draft_cache = None
            if self.drafts is not None:
                draft_cache = self.pool.draft_caches[i] if self.pool is not None else self.drafts.new_cache()
                try:
                    self.drafts.capture(draft_cache)
                except Exception as exc:
                    if self.drafts._compiled_block is None:
                        raise
                    self.compile_error = f"drafter: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                    say(f"torch.compile of the drafter failed ({self.compile_error}); capturing without it")
                    self.drafts._compiled_block = None
                    self.drafts.capture(draft_cache)
                cache.sink = draft_cache.static.feats
                cache.draft_next = (draft_cache.static.count, draft_cache.static.ids, draft_cache)
                cache.max_path = draft_cache.static.ids.shape[0]
            try:
                self.target.capture(cache)
            except Exception as exc:  # a compiler failure must not take the server down
                if not self.target.compiled:
                    raise
                self.compile_error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                say(f"torch.compile failed ({self.compile_error}); capturing without it")
                self.target.compiled = False
                torch._dynamo.reset()
                self.target.capture(cache)
            self.add_slot(cache, draft_cache)
            if draft_cache is not None:
                source = draft_cache.static.out.data_ptr()
                self._tree_graphs(CHAIN, depth, source)  # DFlash rounds
                for budget in budgets:
                    if budget > 0:
                        self._tree_graphs(int(budget), depth, source)
            spans = sorted({kv for _, kv in cache.graphs})
            say(f"captured CUDA graphs for session slot {i + 1}/{self.slots} "
                f"(verify buckets {sorted(cache.stages)} at KV spans {spans}, {len(cache.graphs)} graphs)")
        if self.pool is not None:
            for i in range(self.slots, self.pool.slots):  # pool slots beyond the graphs' run eagerly
                self.add_slot(self.pool.caches[i], self.pool.draft_caches[i] if self.drafts else None)
            say(f"KV pool: {self.pool.slots} sessions, {self.pool.nbytes() / 2**30:.2f} GiB")
        self.graphs = True
        if self.pool is not None and self.pool.slots > 1:
            from ddtree.engine.reference.fast.batch_graph import precapture

            from ddtree.engine.reference.fast import prefill

            precapture(self.engine, tuple(b for b in budgets if b > 0), say)
            prefill.precapture(self.engine, say)

    def prefill_stage(self):
        """The buffers of the pool's prefill graphs (made on first use)."""
        if self._prefill_stage is None:
            from ddtree.engine.reference.fast.prefill import PrefillStage

            self._prefill_stage = PrefillStage(self.engine)
        return self._prefill_stage

    def round_stage(self):
        """The buffers of the pool's graphed rounds (made on first use)."""
        if self._round_stage is None:
            from ddtree.engine.reference.fast.batch_graph import RoundStage

            self._round_stage = RoundStage(self.engine, self.pool)
        return self._round_stage

    def pool_usage(self) -> dict | None:
        """What the KV pool held after the engine thread's last change to it: a snapshot, so
        another thread (the server's /server_info, /metrics) reads it without touching a lease."""
        return self._usage

    def refresh_usage(self) -> None:
        """Take the snapshot pool_usage returns (on the engine thread: leases, releases, rounds)."""
        pool = self.pool
        if pool is None:
            return
        held = [lease.peek() for lease in list(self._leases.values())]
        tokens = sum(info[0].length for info in held if info is not None)
        used = sum(1 for info in held if info is not None)
        del held
        self._usage = {"slots": pool.slots, "free_slots": pool.slots - used, "used_slots": used,
                       "bytes": pool.nbytes(), "bytes_per_token": pool.bytes_per_token,
                       "tokens_per_slot": pool.slot_tokens, "used_tokens": tokens,
                       "token_usage": tokens / (pool.slots * pool.slot_tokens)}
        if self._round_stage is not None:  # rounds run ahead: launched, taken, dropped
            self._usage["rounds_ahead"] = dict(self._round_stage.ahead_counts)
        self._usage["steps_ahead"] = dict(self.steps.counts)

    def add_slot(self, cache, draft_cache) -> None:
        """Put a (target cache, drafter cache) pair in the pool that sessions draw from."""
        pair = (cache, draft_cache)
        static = draft_cache.static if draft_cache is not None else None
        if static is not None:
            # Walks of this slot stage the accepted features in the drafter's rows (commit.py);
            # a walk graph captured without a sink keeps writing none (it says so on its io).
            cache.sink = static.feats
            cache.draft_next = (static.count, static.ids, draft_cache)
            cache.max_path = static.ids.shape[0]  # a tree of the drafter's block: at most B nodes deep
            self._sources[static.out.data_ptr()] = (static.out, static.ids, cache)
        self._slots.append(pair)
        self._free.append(pair)

    def slot_of(self, cache) -> tuple | None:
        """The slot a session's cache was drawn from, or None (a cache of its own)."""
        lease = self._leases.get(id(cache)) if cache is not None else None
        info = lease.peek() if lease is not None else None  # (cache, func, (key, slot), kwargs)
        return info[2][1] if info is not None else None

    def new_caches(self, drafting: bool):
        if self._free:
            if self.pool is not None:
                # Lowest slot first: the running sessions then fill slots 0..b-1, the block a
                # batched round reads (fast/batch.py).
                at = min(range(len(self._free)), key=lambda i: self._free[i][0].slot)
                slot = self._free.pop(at)
            else:
                slot = self._free.pop()
            cache = slot[0].share()
            draft_cache = slot[1].share() if drafting and slot[1] is not None else None
            key = id(cache)
            # Held by the session only: when it goes without release(), the slot comes back.
            self._leases[key] = weakref.finalize(cache, self._give_back, key, slot)
            if self._round_stage is not None and self.pool is not None:
                # What the graphed rounds staged for this slot belonged to its last session.
                self._round_stage.holds.pop(self.pool.index_of(cache), None)
            self.refresh_usage()
            return cache, draft_cache
        cache = self.target.new_cache()
        return cache, self.drafts.new_cache() if drafting else None

    def release(self, cache, draft_cache) -> None:
        lease = self._leases.get(id(cache)) if cache is not None else None
        if lease is not None:
            lease()  # runs _give_back once; the finalizer is dead afterwards

    def _give_back(self, key: int, slot: tuple) -> None:
        self._leases.pop(key, None)
        if not any(slot is free for free in self._free):
            self._free.append(slot)
        self.refresh_usage()

    def before_step(self, session) -> None:
        """A session about to step alone: a pool round run ahead with it in goes back first
        (its slot's own graphs read the host's length); a prefill means a session joins the
        pool's next round, which then runs no round ahead of it."""
        if session._bonus is None and self.pool is not None:
            if len(self.joining) > 4 * self.pool.slots:  # no pool round in a long while: stale
                self.joining.clear()
            self.joining.add(id(session))
        stage = self._round_stage
        pending = stage.ahead if stage is not None else None
        if pending is not None and session._cache is not None:
            row = pending.rows.get(session._cache.slot)
            if row is not None and row[0]() is session:
                from ddtree.engine.reference.fast.batch_graph import drop_ahead

                drop_ahead(self.engine)

    def ar_step(self, cache, bonus: int, again: bool) -> int | None:
        """A greedy AR step on its slot's graphs, the next one queued before this token is read
        when `again` (fast/step_ahead.py); None where that path does not serve the cache."""
        engine = self.engine
        again = again and self.round_ahead and not engine.sync_timings
        return self.steps.step(cache, bonus, again, engine.gpu_busy)

    def draft(self, bonus: int, start: int, pending: torch.Tensor, draft_cache, depth: int) -> torch.Tensor:
        return self.drafts.draft(bonus, start, pending, draft_cache, depth)

    def tree(self, bonus: int, draft_logits: torch.Tensor | None, chain: bool, budget: int) -> Tree:
        device = self.target.device
        self._staged_tree = None
        if draft_logits is None:
            return _device_chain(bonus, None, device)
        depth = int(draft_logits.shape[0])
        source = draft_logits.data_ptr() if draft_logits.is_contiguous() else 0
        slot = self._sources.get(source)
        if chain and slot is None:
            return _device_chain(bonus, draft_logits.argmax(dim=-1), device)
        if chain:
            budget = CHAIN  # the key of a chain's graph: one per depth and slot
        if self.graphs:
            if slot is not None:
                # The slot's draft output, read in place, with the bonus the draft step staged
                # in the drafter's ids[0]: the replay needs no input copied, and it writes the
                # verify's inputs into the slot's stage (stage_tree).
                graph = self._tree_graph(budget, depth, source)
            else:
                graph = self._tree_graph(budget, depth)
                graph.logits.copy_(draft_logits)
                graph.root.fill_(bonus)
            graph.graph.replay()
            tree, staged = graph.tree, graph.staged  # overwritten by the next replay: a round is done with it by then
        else:
            if chain:
                tree = chain_of(bonus, draft_logits, device)
            else:
                tree = build_tree_device(bonus, torch.log_softmax(draft_logits, dim=-1), budget)
            staged = self.target.stage_tree(slot[2], tree) if slot is not None else None
        if staged is not None:
            self._staged_tree = (tree.tokens, staged, slot[2].stages[staged])
        return tree

    def verify(self, tree: Tree, start: int, cache, mask):
        """The target forward over a tree's nodes (features on); where the tree build staged the
        inputs in this cache's stage, a replay with nothing copied in."""
        staged, self._staged_tree = self._staged_tree, None
        self._parents_staged = None
        if staged is not None and staged[0] is tree.tokens and cache.stages.get(staged[1]) is staged[2]:
            out = self.target.forward_staged(cache, tree.size, staged[1])
            if out is not None:
                self._parents_staged = tree.tokens
                return out
        # A round reads the verify's outputs before the next forward: no copies out of the stage.
        return self.target.forward(tree.tokens, tree.depths + start, cache, mask, features=True, copy=False)

    def _tree_graphs(self, budget: int, depth: int, source: int = 0) -> None:
        """The tree builds of one budget and source at every draft depth up to `depth`. A
        request's last rounds draft shallower (Session._depth_cap: tokens still wanted), and a
        depth first met mid-serving captured its graph then, compiling the tree kernel where its
        padded sizes change (three more kernels a budget on the demo pair): on an H200 its first
        one-session DDTree-64 requests stalled for seconds (49 tok/s in a cell whose median
        request took 27 ms; bench/RESULTS.md)."""
        for d in range(depth, 0, -1):
            self._tree_graph(budget, d, source)

    def _tree_graph(self, budget: int, depth: int, source: int = 0) -> _TreeGraph:
        key = (budget, depth, source)
        if key not in self._trees:
            target = self.target
            slot_cache = None
            if source:
                out, ids, slot_cache = self._sources[source]
                logits, root = out[:depth], ids[:1]
            else:
                logits = torch.zeros((depth, target.vocab_size), dtype=torch.float32, device=target.device)
                root = torch.zeros(1, dtype=torch.long, device=target.device)
            staged: list = [None]

            def build():
                if budget == CHAIN:
                    tree = chain_of(root, logits, target.device)
                else:
                    tree = build_tree_device(root, torch.log_softmax(logits, dim=-1), budget)
                if slot_cache is not None:
                    staged[0] = target.stage_tree(slot_cache, tree)
                return tree
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            # The slot's stages were made under inference mode (FastTarget.capture); writing them
            # from outside it is refused, so the build is warmed up and captured inside it too.
            graph, tree = record_graph(build, self._pool, target.device, 2, inference=True)
            self._trees[key] = _TreeGraph(graph, logits, root, tree, staged[0])
        return self._trees[key]

    def mask(self, tree: Tree, start: int, dtype: torch.dtype):
        return self.target.tree_mask(tree, start)

    def walk(self, tree: Tree, posterior: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
        """After a static verify: the walk+commit graph (or its code on a CPU), which also moves
        the accepted K/V rows; after an eager one, the device walk. One host sync either way."""
        return self.walk_logits(tree, None, lambda _logits: posterior, False, int(posterior.shape[0]))

    def walk_logits(self, tree: Tree, logits: torch.Tensor | None, choose, greedy: bool,
                    n: int | None = None, *, ahead: bool = False) -> tuple[torch.Tensor, list[int], list[int]]:
        """walk(tree, choose(logits)), where a greedy walk after a static verify takes the
        argmax inside the walk graph (no argmax launched, the logits never leave the stage).

        ahead: a next round may draft. On a slot whose walk writes the drafter's inputs, that
        round's draft step is then queued right after the walk, before the host waits for the
        walk's result, so the GPU drafts while the host books this round and comes back
        (FastDrafter.draft_ahead; its next draft() takes the logits, anything else drops them)."""
        n = tree.size if n is None else n
        last = self.target.take_verify(n)
        staged, self._parents_staged = self._parents_staged, None
        if last is not None and tree.size == last.n:
            parents = None if staged is tree.tokens else tree.parents
            # Not while a round's parts are timed one by one (Engine.sync_timings): the next
            # draft would be timed as this round's commit.
            ahead = ahead and self.draft_ahead and not self.engine.sync_timings
            draft = self._ahead_cache(last.cache()) if ahead else None
            then = None
            if draft is not None:
                def then(draft=draft, start=last.start):
                    self.drafts.draft_ahead(draft, start)
            if greedy:
                out = self.target.walk_commit(last, parents, None, greedy=True, copy=False, then=then)
            else:
                out = self.target.walk_commit(last, parents, choose(logits), copy=False, then=then)
            if self.target.wrote_next:
                self.drafts.note_ahead(last.cache().draft_next[2], len(out[1]), out[2][-1])
            return out
        posterior = choose(logits)
        order, count = walk_device(tree, posterior)
        return fetch_walk(tree, posterior, order, count)

    def _ahead_cache(self, cache):
        """The slot's drafter cache whose next draft step can run ahead of this cache's walk, or None."""
        if cache is None or cache.draft_next is None:
            return None
        draft = cache.draft_next[2]
        static = draft.static
        if static is None or not static.buckets or static.buckets[-1] < (cache.max_path or 0):
            return None
        return draft

    def accepted_features(self, features: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
        """The accepted rows' features for the next draft (where the walk staged them, no copy)."""
        return self.target.accepted_features(features, path)


@dataclass
class _TreeGraph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor   # [depth, V] float32 input
    root: torch.Tensor     # [1] long input
    tree: Tree             # outputs
    staged: int | None = None  # the query bucket whose verify inputs a replay writes (stage_tree)


def chain_of(root: int | torch.Tensor, draft_logits: torch.Tensor, device) -> Tree:
    """A DFlash round's chain: the bonus, then the argmax draft at each depth."""
    return _device_chain(root, draft_logits.argmax(dim=-1), device)


def _device_chain(root: int | torch.Tensor, drafts: torch.Tensor | None, device) -> Tree:
    """The bonus (an int, or a [1] long device tensor) and the chain of drafts under it, made
    on the device without a host copy (graph-ready with a tensor root)."""
    n = 1 + (0 if drafts is None else int(drafts.shape[0]))
    tokens = torch.empty(n, dtype=torch.long, device=device)
    if isinstance(root, torch.Tensor):
        tokens[:1].copy_(root)
    else:
        tokens[:1].fill_(root)
    if drafts is not None:
        tokens[1:].copy_(drafts)
    steps = torch.arange(n, device=device)
    return Tree(tokens, steps, (steps - 1).clamp(min=0), True, n - 1)
