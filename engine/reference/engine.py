"""The builtin engine: a target, an optional DFlash drafter, and sessions that decode with them.

    engine = Engine.load("assets/demo/target", "assets/demo/drafter")
    result = engine.generate(ids, GenParams(max_new_tokens=64), SpecParams("ddtree", budget=32))

A server interleaves requests round by round from one thread: `Session.step()` on each in turn, or
`engine.step_many(sessions)`, which runs the same rounds with one drafter and one target forward
for all of them (batch.py).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from torch import nn

from ddtree.engine.arch import (SPECULATIVE_HINT, drafter_as_target, is_speculative, read_config,
                               speculative_refusal)
from ddtree.engine.reference.backends import BACKENDS, TransformersPath
from ddtree.engine.reference.batch import step_many
from ddtree.engine.reference.decode import Session
from ddtree.engine.reference.drafter import DFlashDrafter, load_drafter
from ddtree.engine.reference.errors import BadParams, ModelLoadError
from ddtree.engine.reference.loading import (
    eos_token_ids,
    is_demo_pair,
    load_target_model,
    load_tokenizer,
    resolve_dtype,
    resolve_model_dir,
    resolve_mask_token_id,
)
from ddtree.engine.reference.params import GenParams, GenResult, SpecParams, within_prefill_cap
from ddtree.engine.reference.target import Target, hybrid_reason

__all__ = ["Engine", "GenParams", "SpecParams", "Session", "GenResult"]

log = logging.getLogger(__name__)

DEFAULT_MAX_BUDGET = 1024
# The fast backend preallocates the context window for every session slot: without an explicit
# window it holds this many tokens, not a model's whole max_position_embeddings (40960 for Qwen3).
FAST_CONTEXT = 8192
# Verify graphs are captured up to this many query rows; a larger tree verifies eagerly.
MAX_GRAPH_QUERY = 1024


class Engine:
    def __init__(self, model: nn.Module, drafter: DFlashDrafter | None = None, tokenizer=None, *,
                 model_name: str = "target", draft_name: str | None = None,
                 eos_token_ids: tuple[int, ...] = (), mask_token_id: int | None = None,
                 max_budget: int = DEFAULT_MAX_BUDGET, context_window: int | None = None,
                 block_size: int | None = None, backend: str = "transformers", graphs: bool = True,
                 slots: int | None = None, compile: bool = True, pool_slots: int = 0,
                 pool_bytes: int | None = None, attention: str = "auto") -> None:
        """Wrap already-built modules (Engine.load builds them from checkpoints).

        backend: "transformers" (the reference, any architecture) or "fast" (our own forward for
        dense Qwen3/Llama/Qwen2 decoders: static caches, trees on the device, and on CUDA graphs
        captured by `warmup()` for `slots` concurrent sessions, with the decoder layer run through
        torch.compile first unless compile=False; pool_slots > 0 keeps that many sessions' K/V in
        one pool that step_many batches in place, fast/pool.py). `model` is a transformers model
        (the fast backend then shares its weights) or, for "fast", a fast.model.DenseDecoder.
        context_window: tokens a session may hold (default the model's max_position_embeddings;
        the fast backend preallocates it per slot, so it caps that default at FAST_CONTEXT).
        attention: the fast backend's attention kernel, "auto", "triton", "matmul" or "sdpa"
        (fast.model.choose_attention); the transformers backend ignores it.

        block_size: verify at most this many tokens a round (2..drafter.block_size; the attribute
        may also be reassigned later within that range). The drafter still drafts its own trained
        block length, which it needs to draft well; only the first block_size - 1 drafts are used.
        """
        if backend not in ("transformers", "fast"):
            raise BadParams(f"unknown backend {backend!r}", "use transformers or fast (auto is for Engine.load)")
        self.backend = backend
        self.drafter = drafter.eval() if drafter is not None else None
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.draft_name = draft_name if drafter is not None else None
        self.eos_token_ids = tuple(eos_token_ids)
        feature_layers = drafter.target_layer_ids if drafter is not None else ()
        cw = context_window or getattr(model.config, "max_position_embeddings", None) or 4096
        if backend == "fast":
            from ddtree.engine.reference.fast import blas
            from ddtree.engine.reference.fast.backend import decoder_from_hf
            from ddtree.engine.reference.fast.model import DenseDecoder
            from ddtree.engine.reference.fast.target import FastTarget

            weight = next(model.parameters(), None)
            if weight is not None and weight.device.type == "cuda":  # before anything here calls cuBLAS
                self.cublas_workspace = blas.ask_small_workspace()
            self.model = model.eval() if isinstance(model, DenseDecoder) else decoder_from_hf(model)
            cw = context_window or min(int(cw), FAST_CONTEXT)
            query = min(int(max_budget), MAX_GRAPH_QUERY - 1) + 1 if drafter is not None else 1
            self.target = FastTarget(self.model, feature_layers, context_window=int(cw),
                                     max_query=max(query, drafter.block_size if drafter is not None else 1),
                                     attention=attention)
        else:
            if not hasattr(model, "get_input_embeddings"):
                raise BadParams(f"the transformers backend needs a transformers model, got {type(model).__name__}",
                                "use backend='fast' for a fast.model.DenseDecoder")
            self.model = model.eval()
            self.target = Target(self.model, feature_layers)
        self.device = str(self.target.device)
        self.dtype = self.target.dtype
        self.context_window = int(cw)
        self.sync_timings = False
        #: Prompt tokens a prefill step takes at most (0: the whole prompt in one step); the
        #: server's --chunked-prefill-size. A target with recurrent layers always prefills whole.
        self.prefill_chunk = 0
        #: Prompt tokens one turn prefills at most (0: no cap); the server's --max-prefill-tokens.
        #: New requests past it wait a turn, the first always going: the scheduler holds them,
        #: or step_many (for a turn the scheduler hands it whole), which also keeps riders'
        #: shapes within it (fast/ride.py).
        self.max_prefill_tokens = 0
        #: Whether a new session's prefill chunk may ride in the running sessions' round (the
        #: server's --enable-mixed-chunk; fast/ride.py: the pooled fast backend only).
        self.mixed_chunk = False
        #: What the last step_many did with new sessions beside a graphed round, for the
        #: scheduler's turn trace: "" (nothing of note), "riders RxW" or "burst" (fast/batch.py).
        self.turn_note = ""
        #: Where the last step_many's host time went when new sessions prefilled beside a round
        #: (fast/batch.py), seconds by part, for the turn trace; empty otherwise.
        self.turn_parts: dict[str, float] = {}
        #: The last step_many's seconds in on_gpu_wait ("push": a server's writes) and blocked on
        #: the graphed round's GPU work after it ("gpu"): a round whose "gpu" is near 0 had its
        #: host work, the writes included, on the critical path. For the turn trace and bench.
        self.turn_waits: dict[str, float] = {}
        #: New sessions the last step_many left for a later turn under max_prefill_tokens (the
        #: scheduler adds them to its trace's "held" where it left the cap to the engine).
        self.turn_held = 0
        # Recurrent (linear-attention, Mamba) layers: such a target decodes with ar only; start()
        # refuses dflash and ddtree (arch.speculative_refusal says why).
        self.hybrid_reason = hybrid_reason(model.config)
        self.hybrid_warning = None
        if self.hybrid_reason and drafter is not None:
            self.hybrid_warning = (f"{self.hybrid_reason}: the builtin engine decodes it with ar only "
                                   f"and refuses dflash and ddtree ({SPECULATIVE_HINT})")
            log.warning("%s", self.hybrid_warning)
        if drafter is None:
            self.block_size = 1
            self.max_budget = 0
            self.mask_token_id = None
        else:
            self._check_drafter(drafter)
            if block_size is not None and not (isinstance(block_size, int) and 2 <= block_size <= drafter.block_size):
                raise BadParams(f"block size {block_size!r} must be between 2 and the drafter's {drafter.block_size}")
            self.block_size = block_size or drafter.block_size
            self.max_budget = int(max_budget)
            mask = mask_token_id if mask_token_id is not None else drafter.mask_token_id
            if mask is None or not 0 <= mask < self.target.vocab_size:
                raise ModelLoadError(f"drafter mask token id {mask} is not in the target's vocabulary",
                                     "set dflash_config.mask_token_id in the drafter's config.json")
            self.mask_token_id = int(mask)
        if backend == "fast":
            from ddtree.engine.reference.fast.backend import DEFAULT_SLOTS, FastPath

            self.impl = FastPath(self, self.target, self.drafter, slots=slots or DEFAULT_SLOTS, graphs=graphs,
                                 compile=compile, pool_slots=pool_slots, pool_bytes=pool_bytes)
        else:
            self.impl = TransformersPath(self)

    @property
    def vocab_size(self) -> int:
        """The target's embedding rows (may exceed the tokenizer's size: padded vocabularies)."""
        return self.target.vocab_size

    @property
    def attention(self) -> str:
        """The attention kernel of the fast backend's static rounds (fast.model.choose_attention),
        or "transformers" on the transformers backend (its attn_implementation)."""
        return getattr(self.target, "attention", "transformers")

    @property
    def graphs(self) -> bool:
        """Whether rounds replay captured CUDA graphs (fast backend on CUDA, after warmup)."""
        return self.impl.graphs

    def warmup(self, progress=None, budgets: tuple[int, ...] = ()) -> None:
        """Prepare what the first request would otherwise wait for: on the fast backend on CUDA,
        the session slots' CUDA graphs and the tree builds of these DDTree budgets.
        `progress(message)` hears each step."""
        if isinstance(self.impl, TransformersPath):
            return
        self.impl.warmup(progress, tuple(b for b in budgets if 0 < b <= self.max_budget))

    #: Called on the engine's thread right before a round blocks on the GPU, which is busy
    #: then: the server's engine process writes its held updates there (engine_loop._Outbox).
    on_gpu_wait = None

    def gpu_busy(self) -> None:
        """The host is about to wait for the GPU: hand that time to on_gpu_wait."""
        if self.on_gpu_wait is not None:
            t0 = time.perf_counter()
            self.on_gpu_wait()
            self.count_wait("push", time.perf_counter() - t0)

    def count_wait(self, name: str, seconds: float) -> None:
        """Add to this step_many's turn_waits."""
        self.turn_waits[name] = self.turn_waits.get(name, 0.0) + seconds

    def clock(self) -> float:
        """perf_counter for the per-stage timings; waits for the GPU first when sync_timings is on."""
        if self.sync_timings and self.target.device.type == "cuda":
            torch.cuda.synchronize(self.target.device)
        return time.perf_counter()

    def _check_drafter(self, drafter: DFlashDrafter) -> None:
        cfg = drafter.config
        target = self.target
        problems = []
        if cfg.hidden_size != target.hidden_size:
            problems.append(f"hidden size {cfg.hidden_size} != target {target.hidden_size}")
        if target.num_layers and max(cfg.target_layer_ids) >= target.num_layers:
            problems.append(f"target_layer_ids {list(cfg.target_layer_ids)} exceed the target's "
                            f"{target.num_layers} layers")
        if target.num_layers and cfg.num_target_layers != target.num_layers:
            log.warning("drafter was built for %d target layers, target has %d",
                        cfg.num_target_layers, target.num_layers)
        if problems:
            raise ModelLoadError("drafter does not fit the target: " + "; ".join(problems),
                                 "pair the drafter with the target it was trained for")
        if next(drafter.parameters()).device != target.device or next(drafter.parameters()).dtype != target.dtype:
            drafter.to(device=target.device, dtype=target.dtype)

    @classmethod
    def load(cls, model: str | Path, draft: str | Path | None = None, *, device: str = "cpu",
             dtype=None, attn_implementation: str = "sdpa",
             max_budget: int = DEFAULT_MAX_BUDGET, block_size: int | None = None,
             algorithm: str | None = None, budget: int | None = None, backend: str = "auto",
             context_window: int | None = None, graphs: bool = True, compile: bool = True,
             slots: int | None = None, pool_slots: int = 0, pool_bytes: int | None = None,
             attention: str = "auto") -> Engine:
        """Load a target and (optionally) a DFlash drafter from dirs or hub ids.

        algorithm/budget: what the caller will decode with by default (a server's --algorithm). A
        speculative one on a target with recurrent layers is refused here, before any weight loads.
        backend: "auto" takes "fast" on CUDA for the architectures it supports and "transformers"
        otherwise; `engine.backend_reason` says why. "fast" on a CPU runs its non-graph code.
        pool_slots/pool_bytes: the fast backend's KV pool, pool_slots sessions or as many as
        pool_bytes hold if fewer (Engine's pool_slots); the transformers backend ignores both.
        slots: concurrent sessions the fast backend captures graphs for (Engine's slots).
        attention: the fast backend's attention kernel (Engine's attention).
        """
        device = str(device)
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise BadParams("device cuda requested but CUDA is not available", "use --device cpu")
        target_dir = resolve_model_dir(model)
        misplaced = drafter_as_target(read_config(target_dir))
        if misplaced:
            raise BadParams(f"{model}: {misplaced}")
        torch_dtype = resolve_dtype(dtype, device, demo=is_demo_pair(target_dir))
        if draft is not None and algorithm is not None and is_speculative(algorithm, budget):
            reason = hybrid_reason(read_config(target_dir))
            if reason:
                raise BadParams(speculative_refusal(reason, algorithm), SPECULATIVE_HINT)
        chosen, why = choose_backend(backend, read_config(target_dir), device)
        if chosen == "fast":
            from ddtree.engine.reference.fast.model import load_decoder

            target = load_decoder(target_dir, device=device, dtype=torch_dtype)
        else:
            target = load_target_model(target_dir, device=device, dtype=torch_dtype,
                                       attn_implementation=attn_implementation)
        tokenizer = load_tokenizer(target_dir)
        drafter = None
        mask_id = None
        if draft is not None:
            draft_dir = resolve_model_dir(draft)
            drafter = load_drafter(draft_dir, device=device, dtype=torch_dtype)
            if drafter.mask_token_id is None:
                mask_id = resolve_mask_token_id(draft_dir, tokenizer)
        engine = cls(target, drafter, tokenizer, model_name=str(model),
                     draft_name=str(draft) if draft is not None else None,
                     eos_token_ids=eos_token_ids(target_dir, target.config, tokenizer),
                     mask_token_id=mask_id, max_budget=max_budget, block_size=block_size,
                     backend=chosen, context_window=context_window, graphs=graphs, compile=compile,
                     slots=slots, pool_slots=pool_slots, pool_bytes=pool_bytes, attention=attention)
        engine.backend_reason = why
        log.info("backend %s: %s", chosen, why)
        return engine

    backend_reason = "chosen by the caller"
    #: CUBLAS_WORKSPACE_CONFIG as the fast backend on CUDA found or set it (fast/blas.py); None elsewhere.
    cublas_workspace: str | None = None
    #: torch's CPU threads for the rounds, as the server set them (None: not a server's engine).
    cpu_threads: int | None = None

    def start(self, input_ids: list[int], gen: GenParams | None = None,
              spec: SpecParams | None = None) -> Session:
        gen = gen or GenParams()
        spec = spec or SpecParams()
        ids = list(input_ids) if not isinstance(input_ids, (str, bytes)) else None
        if not ids:
            raise BadParams("input_ids must be a non-empty list of token ids")
        vocab = self.target.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise BadParams(f"input_ids must be integers in 0..{vocab - 1}")
        if len(ids) >= self.context_window:
            raise BadParams(f"prompt of {len(ids)} tokens does not fit the context window "
                            f"({self.context_window})", "shorten the prompt")
        if is_speculative(spec.algorithm, spec.budget):
            if self.hybrid_reason:
                raise BadParams(speculative_refusal(self.hybrid_reason, spec.algorithm), SPECULATIVE_HINT)
            if self.drafter is None:
                raise BadParams(f"algorithm {spec.algorithm} needs a drafter", "load one with --draft")
            if spec.algorithm == "ddtree" and spec.budget > self.max_budget:
                raise BadParams(f"budget {spec.budget} exceeds this engine's maximum {self.max_budget}")
        return Session(self, ids, gen, spec)

    def late_compiles(self) -> int | None:
        """Triton kernels compiled while serving, after the server's warm-up (each one a stall
        for every stream); None where that is not watched (no CUDA graphs, or an old Triton)."""
        if not self.graphs:
            return None
        from ddtree.engine.reference.fast import graphs

        return len(graphs.late_compiles) if graphs.watching else None

    @property
    def round_ahead(self) -> bool:
        """Whether anything runs ahead of the host: rounds on the KV pool (fast/batch_graph.py,
        on graphs or the batched static path) or, under the same switch FastPath.round_ahead, a
        lone greedy AR step on the target's static path (fast/step_ahead.py), which a fast
        engine without a pool has too."""
        impl = self.impl
        if self.backend != "fast" or not impl.round_ahead:
            return False
        return impl.graphs or impl.target.static or (impl.pool is not None and impl.batch_static)

    def pool_usage(self) -> dict | None:
        """The fast backend's KV pool: slots, free slots, bytes, tokens held (None: no pool)."""
        usage = getattr(self.impl, "pool_usage", None)
        return usage() if usage is not None else None

    def lone_round(self, session: Session) -> bool:
        """Whether this running session, the only one of a turn, should step through step_many
        rather than alone (Session.step): on the pooled fast backend, a slot without graphs of its
        own takes the pool's graphed round instead of an eager forward (fast/batch.py)."""
        if self.backend != "fast" or self.impl.pool is None or session.done or session._bonus is None:
            return False
        from ddtree.engine.reference.fast.batch import _lone_round

        return self.impl.pool.index_of(session._cache) is not None and _lone_round(self, session)

    def step_many(self, sessions: list[Session]) -> list[list[int]]:
        """One round of each session, batched: every draft in one drafter forward and every verify
        in one target forward (on a CPU, verifies of very different sizes go in separate forwards).

        Returns each session's newly committed tokens, as `Session.step()` would; a session that
        is done gets [], one not yet prefilled gets its prefill (with mixed_chunk on the pooled
        fast backend, beside a graphed round: some of them get their next chunk inside that round
        and the others [], untouched; fast/ride.py). Past max_prefill_tokens a new session also
        gets [], untouched, and waits (turn_held counts them). Outputs equal stepping the sessions one by
        one (at temperature 0 token for token; seeded sampling draws the same). If the batched
        round raises, no session in it has changed, the riding ones included; the new sessions
        that prefilled beside it are new again (fast/prefill.py: their first tokens are read
        after the round), and the others' prefills before it have happened, each complete.
        """
        sessions = list(sessions)
        self.turn_note, self.turn_held, self.turn_parts, self.turn_waits = "", 0, {}, {}
        # Checked here once for every backend below: batch.step_many and fast/batch.step_many
        # trust their caller for it.
        if len({id(s) for s in sessions}) != len(sessions):
            raise BadParams("step_many got the same session twice")
        if any(s.engine is not self for s in sessions):
            raise BadParams("step_many got a session of another engine")
        if self.backend == "fast" and self.impl.pool is not None:
            # Sessions on the KV pool batch in place (fast/batch.py).
            from ddtree.engine.reference.fast.batch import step_many as fast_step_many

            return fast_step_many(self, sessions)
        # What prefills beside the round here is each new session's whole next step: cap it
        # (the pooled fast backend caps what does not ride, in its own step_many).
        held = self.held_by_prefill_cap(sessions)
        stepped = [s for s in sessions if id(s) not in held]
        if self.hybrid_reason or self.backend == "fast":
            # A recurrent state cannot be padded or stacked the way KV rows are, and a fast
            # engine without a pool (pool_slots=0) has a cache per session: one by one.
            results = iter([s.step() for s in stepped])
        else:
            results = iter(step_many(self, stepped))
        self.turn_held = len(held)
        return [[] if id(s) in held else next(results) for s in sessions]

    def held_by_prefill_cap(self, sessions: list[Session]) -> set[int]:
        """ids of the new sessions among these that max_prefill_tokens leaves for a later turn
        (params.within_prefill_cap: in order, the first always goes)."""
        new = [s for s in sessions if not s.done and s._bonus is None]
        go = within_prefill_cap([s.next_prefill_tokens() for s in new], self.max_prefill_tokens)
        return {id(s) for s, ok in zip(new, go) if not ok}

    def generate(self, input_ids: list[int], gen: GenParams | None = None,
                 spec: SpecParams | None = None) -> GenResult:
        t0 = time.perf_counter()
        sess = self.start(input_ids, gen, spec)
        try:
            while not sess.done:
                sess.step()
        finally:
            sess.close()
        return GenResult(
            output_ids=sess.output_ids,
            accept_lengths=sess.accept_lengths,
            verify_ct=sess.verify_ct,
            finish_reason=sess.finish_reason,
            prompt_tokens=sess.prompt_tokens,
            elapsed_s=time.perf_counter() - t0,
            timings=dict(sess.timings),
            block_size=self.block_size,
        )


def choose_backend(backend: str, config: dict, device: str) -> tuple[str, str]:
    """(backend, why) for a target's config.json: "auto" takes fast on CUDA where it can run."""
    from ddtree.engine.reference.fast.model import unsupported_reason

    if backend not in BACKENDS:
        raise BadParams(f"unknown backend {backend!r}", f"use one of {', '.join(BACKENDS)}")
    if backend == "transformers":
        return backend, "asked for"
    reason = unsupported_reason(config)
    if backend == "fast":
        if reason:
            raise BadParams(f"the fast backend cannot run this target: {reason}", "use --backend transformers or auto")
        return backend, "asked for"
    if reason:
        return "transformers", f"auto: the fast backend does not support it ({reason})"
    if not str(device).startswith("cuda"):
        return "transformers", ("auto: fast is the default on CUDA; on a CPU the reference path is used, whose caches "
                                "grow as needed (--backend fast preallocates every slot's)")
    return "fast", f"auto: {config.get('model_type', 'this')} is a dense attention decoder on CUDA"
