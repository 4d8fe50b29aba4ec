"""One generation, round by round: AR, DFlash chain, DDTree tree.

A round drafts one block, builds a chain or tree from it, verifies every node in one target
forward, walks the accepted path and commits it. Every committed token is the target's own choice
at its true prefix (argmax, or a sample at T > 0), so the output is exactly what plain decoding
would give: the draft only decides how many of those choices one forward can confirm.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ddtree.engine.reference.params import TIMING_KEYS, GenParams, SpecParams, accept_histogram
from ddtree.engine.reference.tree import Tree

if TYPE_CHECKING:
    from ddtree.engine.reference.engine import Engine


def sample(logits: torch.Tensor, temperature: float, top_p: float,
           generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of logits [n, V]: argmax at T=0, else a (nucleus) sample."""
    if temperature < 1e-5:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p. The top token always stays, set
        # here rather than left to the comparison: a top_p below the dtype's smallest number
        # (1e-300 in float32) rounds to 0, and 0 >= 0 would drop every token.
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
        drop[..., 0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


class Session:
    """One request's decoding state. Not thread-safe: drive all sessions from one thread."""

    def __init__(self, engine: Engine, input_ids: list[int], gen: GenParams, spec: SpecParams) -> None:
        self.engine = engine
        self.gen = gen
        self.spec = spec
        self.prompt_ids = list(input_ids)
        self.output_ids: list[int] = []
        self.accept_lengths: list[int] = []
        self.verify_ct = 0
        self.done = False
        self.finish_reason: str | None = None
        self.timings = dict.fromkeys(TIMING_KEYS, 0.0)
        if spec.algorithm == "ar" or (spec.algorithm == "ddtree" and spec.budget == 0):
            self.mode = "ar"
        else:
            self.mode = "chain" if spec.algorithm == "dflash" else "tree"
        target = engine.target
        self._cache, self._draft_cache = engine.impl.new_caches(self.mode != "ar")
        self._pending: torch.Tensor | None = None  # features of committed rows not yet drafted on
        self._start = 0                            # rows in the target KV cache
        self._bonus: int | None = None             # last committed token, not yet in the cache
        self._prefilled_rows = 0                   # prompt tokens in the cache (a chunked prefill)
        self._prefill_features: list[torch.Tensor] = []
        self._stops = set(gen.stop_token_ids)
        if not gen.ignore_eos:
            self._stops.update(engine.eos_token_ids)
        self._generator: torch.Generator | None = None
        if not gen.greedy:
            self._generator = torch.Generator(device=target.device)
            if gen.seed is None:
                self._generator.seed()
            else:
                self._generator.manual_seed(gen.seed)

    # ---- public -----------------------------------------------------------------------------
    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    def accept_histogram(self) -> list[int]:
        return accept_histogram(self.accept_lengths, self.engine.block_size)

    def kv_bytes(self) -> int:
        """Bytes held by this session's target KV cache (the drafter's is much smaller)."""
        return self._cache.nbytes() if self._cache is not None else 0

    def step(self) -> list[int]:
        """Run one round; return the tokens it committed (empty once done)."""
        if self.done:
            return []
        self.engine.impl.before_step(self)
        with torch.inference_mode():
            if self._bonus is None:
                return self._prefill()
            depth = self._depth_cap()
            if self.mode == "ar" or depth == 0:
                return self._ar_round()
            return self._spec_round(depth)

    def close(self) -> None:
        """Free the caches; a session closed before it finished ends with reason "abort"."""
        if not self.done:
            self.done = True
            self.finish_reason = "abort"
        self._prefill_features = []
        self._free_caches()

    def next_prefill_tokens(self) -> int:
        """Prompt tokens this session's next step prefills: its next chunk, or the rest of its
        prompt (0 once prefilled)."""
        if self._bonus is not None or self.done:
            return 0
        left = len(self.prompt_ids) - self._prefilled_rows
        chunk = self.engine.prefill_chunk
        return min(left, chunk) if self.chunked_prefill and chunk > 0 else left

    @property
    def chunked_prefill(self) -> bool:
        """Whether this session's prefill runs in chunks, one a step: its prompt is longer than
        the engine's prefill_chunk, or a chunk of it is already in the cache."""
        chunk = self.engine.prefill_chunk
        return (self._bonus is None and not self.engine.hybrid_reason
                and (self._prefilled_rows > 0 or 0 < chunk < len(self.prompt_ids)))

    # ---- rounds -----------------------------------------------------------------------------
    def _prefill(self) -> list[int]:
        """The prompt into the cache, then the first token. With a prefill chunk (the server's
        --chunked-prefill-size), one chunk a step and no token until the last one, so a long
        prompt delays the other sessions' rounds by one chunk a turn, not by its whole prefill."""
        t0 = self.engine.clock()
        target = self.engine.target
        device = target.device
        n, start = len(self.prompt_ids), self._prefilled_rows
        chunk = self.engine.prefill_chunk
        end = min(n, start + chunk) if chunk > 0 and self.chunked_prefill else n
        ids = torch.tensor(self.prompt_ids[start:end], dtype=torch.long, device=device)
        positions = torch.arange(start, end, device=device)
        out = target.forward(ids, positions, self._cache, features=self.mode != "ar", last_only=True)
        self._prefilled_rows = end  # the cache holds these rows now, whatever happens next
        committed: list[int] = []
        if end < n:
            if out.features is not None:
                # A copy: a static forward's features are views its next forward overwrites.
                self._prefill_features.append(out.features.clone())
        else:
            features = out.features
            if self._prefill_features:
                features = torch.cat([*self._prefill_features, features], dim=0)
                self._prefill_features = []
            committed = self._prefilled(out.logits, features)
        self.timings["prefill"] += self.engine.clock() - t0
        return committed

    def _prefilled(self, last_logits: torch.Tensor | None, features: torch.Tensor | None,
                   token: int | None = None) -> list[int]:
        """After the prompt is in the cache: choose the first token from the last row's logits
        [1, V] (float), or take `token` already chosen for it (a batched prefill's greedy rows,
        read in one sync), keep the prompt's features for the first draft, commit the token."""
        if token is None:
            token = int(self._choose(last_logits)[-1])
        self._pending = features
        self._start = len(self.prompt_ids)
        self._bonus = int(token)
        return self._commit([self._bonus])

    def _ar_round(self) -> list[int]:
        t0 = self.engine.clock()
        target = self.engine.target
        device = target.device
        features = self.mode != "ar"
        token = None
        if not features and self.gen.greedy:
            token = self.engine.impl.ar_step(self._cache, self._bonus, again=self._may_step_again())
            t1 = self.engine.clock()
        if token is None:
            ids = torch.tensor([self._bonus], dtype=torch.long, device=device)
            positions = torch.tensor([self._start], dtype=torch.long, device=device)
            out = target.forward(ids, positions, self._cache, features=features)
            t1 = self.engine.clock()
            choice = self._choose(out.logits)
            self.engine.gpu_busy()
            token = int(choice[0])
        if features:
            self._pending = torch.cat((self._pending, out.features), dim=0)
        self._start += 1
        self._bonus = token
        self.accept_lengths.append(1)
        self.verify_ct += 1
        committed = self._commit([token])
        t2 = self.engine.clock()
        self.timings["verify"] += t1 - t0
        self.timings["commit"] += t2 - t1
        return committed

    def _spec_round(self, depth: int) -> list[int]:
        engine = self.engine
        target = engine.target
        t0 = self.engine.clock()
        draft_logits = self._draft(depth)
        t1 = self.engine.clock()
        tree = self._tree(draft_logits)
        mask = engine.impl.mask(tree, self._start, target.dtype)
        t2 = self.engine.clock()
        out = engine.impl.verify(tree, self._start, self._cache, mask)
        t3 = self.engine.clock()
        path, path_list, new = self._walk(tree, out.logits, ahead=self._may_draft_again())
        self._cache.compact(self._start, path, path_list)
        features = engine.impl.accepted_features(out.features, path)
        committed = self._advance(path_list, new, features, drafted=True)
        t4 = self.engine.clock()
        self.timings["draft"] += t1 - t0
        self.timings["tree"] += t2 - t1
        self.timings["verify"] += t3 - t2
        self.timings["commit"] += t4 - t3
        return committed

    # ---- round pieces shared with the batched step (batch.py) -------------------------------
    def _walk(self, tree: Tree, logits: torch.Tensor, ahead: bool = False) -> tuple[torch.Tensor, list[int], list[int]]:
        """The target's choice at every node (logits [n, V]), the accepted path and the new
        tokens. ahead: the backend may start the next round's draft before the host reads the walk."""
        return self.engine.impl.walk_logits(tree, logits, self._choose, self.gen.greedy, ahead=ahead)

    def _may_draft_again(self) -> bool:
        """Whether a round that commits one token leaves room for another drafted round (a
        draft run ahead of a round that never comes is wasted GPU time, not a wrong token)."""
        wanted = self.gen.max_new_tokens - len(self.output_ids) - 1
        room = self.engine.context_window - self._start - 1
        return min(self.engine.block_size - 1, wanted - 1, room - 1) > 0

    def _may_step_again(self) -> bool:
        """Whether an AR step that commits one token leaves room for another (a step run ahead
        of one that never comes is wasted GPU time, not a wrong token)."""
        wanted = self.gen.max_new_tokens - len(self.output_ids) - 1
        return wanted > 0 and self._start + 1 < self.engine.context_window

    def _advance(self, path_list: list[int], new: list[int], features: torch.Tensor | None, *,
                 drafted: bool) -> list[int]:
        """Book a verified round whose accepted KV rows already sit at start.. in the cache."""
        if features is not None:
            # A draft consumed the pending features; a round without one must keep them.
            self._pending = features if drafted else torch.cat((self._pending, features), dim=0)
        tau = len(path_list)
        self._start += tau
        self._bonus = new[-1]
        # A round run ahead (fast/batch_graph.py) may accept past the tokens still wanted: it
        # is booked at what it commits, as the round capped at them (_depth_cap) would be.
        self.accept_lengths.append(min(tau, self.gen.max_new_tokens - len(self.output_ids)))
        self.verify_ct += 1
        return self._commit(new)

    def _tree(self, draft_logits: torch.Tensor | None) -> Tree:
        """What one verify checks: the bonus alone (no draft), a chain (DFlash) or a tree (DDTree)."""
        return self.engine.impl.tree(self._bonus, draft_logits, self.mode == "chain", self.spec.budget)

    # ---- helpers ----------------------------------------------------------------------------
    def _depth_cap(self) -> int:
        """How deep a draft may go: the block, the tokens still wanted, the context window."""
        if self.mode == "ar":
            return 0
        wanted = self.gen.max_new_tokens - len(self.output_ids)
        room = self.engine.context_window - self._start
        return max(0, min(self.engine.block_size - 1, wanted - 1, room - 1))

    def _draft(self, depth: int) -> torch.Tensor:
        """Draft logits [depth, V] (float32) for the block after the bonus token; the drafter
        takes the pending features, so none are left pending after it."""
        logits = self.engine.impl.draft(self._bonus, self._start, self._pending, self._draft_cache, depth)
        self._pending = self._pending[:0]
        return logits

    def _choose(self, logits: torch.Tensor) -> torch.Tensor:
        return sample(logits, self.gen.temperature, self.gen.top_p, self._generator)

    def _commit(self, tokens: list[int]) -> list[int]:
        """Append tokens up to a stop token or the length limit; end the session there."""
        room = self.gen.max_new_tokens - len(self.output_ids)
        taken: list[int] = []
        for token in tokens[:room]:
            taken.append(token)
            if token in self._stops:
                self.done, self.finish_reason = True, "stop"
                break
        self.output_ids.extend(taken)
        if not self.done and (len(self.output_ids) >= self.gen.max_new_tokens
                              or self._start >= self.engine.context_window):
            self.done, self.finish_reason = True, "length"
        if self.done:
            self._free_caches()
        return taken

    def _free_caches(self) -> None:
        if self._cache is not None:
            self.engine.impl.release(self._cache, self._draft_cache)
        self._cache = None
        self._draft_cache = None
        self._pending = None
