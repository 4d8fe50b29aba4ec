"""What differs between the two backends, behind one small surface that decode.Session calls.

    transformers  the reference: a transformers model with a DynamicCache, the heap-built tree and
                  the host walk. Any architecture transformers runs, on any device.
    fast          engine/reference/fast: our own forward for dense Qwen3/Llama/Qwen2 decoders,
                  static caches, trees and walks on the device, CUDA graphs on CUDA.

Both give the same tokens: the backend decides how a round is computed, never what it commits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ddtree.engine.reference.tree import (
    Tree,
    accepted_path,
    build_tree,
    chain_tree,
    root_tree,
    tree_attention_mask,
)

if TYPE_CHECKING:
    from ddtree.engine.reference.engine import Engine

BACKENDS = ("auto", "fast", "transformers")


class TransformersPath:
    """The reference backend (what Session did before there were two)."""

    name = "transformers"
    graphs = False

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def warmup(self, progress=None) -> None:
        """Nothing to prepare: transformers runs eagerly."""

    def new_caches(self, drafting: bool):
        engine = self.engine
        return engine.target.new_cache(), engine.drafter.new_cache() if drafting else None

    def release(self, cache, draft_cache) -> None:
        """Dynamic caches are freed with the session."""

    def before_step(self, session) -> None:
        """Nothing runs ahead of a session here."""

    def ar_step(self, cache, bonus: int, again: bool) -> None:
        """No step of its own: Session runs the plain forward."""
        return None

    def draft(self, bonus: int, start: int, pending: torch.Tensor, draft_cache, depth: int) -> torch.Tensor:
        """Draft logits [depth, V] (float32) for the block after the bonus token.

        The block is always the drafter's trained length, even when engine.block_size is shorter:
        the drafter was trained on blocks of that length, and a shorter one collapses acceptance
        (issue 21: tau 1.21 at B=4 against 2.49 for the full block's first 3 rows). A short
        engine.block_size only caps the depth read (Session._depth_cap)."""
        engine = self.engine
        target = engine.target
        device = target.device
        length = engine.drafter.block_size
        block = torch.full((length,), engine.mask_token_id, dtype=torch.long, device=device)
        block[0] = bonus
        cached = draft_cache.get_seq_length()
        positions = torch.arange(cached, start + length, device=device)
        hidden = engine.drafter(target.embed(block)[None], pending[None], positions[None], None, draft_cache)
        return target.lm_head(hidden[0, 1:1 + depth]).float()

    def tree(self, bonus: int, draft_logits: torch.Tensor | None, chain: bool, budget: int) -> Tree:
        """What one verify checks: the bonus alone (no draft), a chain (DFlash) or a tree (DDTree)."""
        if draft_logits is None:
            return root_tree(bonus, self.engine.target.device)
        if chain:
            return chain_tree(bonus, draft_logits.argmax(dim=-1))
        return build_tree(bonus, torch.log_softmax(draft_logits, dim=-1), budget)

    def mask(self, tree: Tree, start: int, dtype: torch.dtype):
        return None if tree.is_chain else tree_attention_mask(tree, start, dtype)

    def verify(self, tree: Tree, start: int, cache, mask):
        """The target forward over a tree's nodes after `start` committed rows, features on."""
        return self.engine.target.forward(tree.tokens, tree.depths + start, cache, mask, features=True)

    def walk_logits(self, tree: Tree, logits: torch.Tensor, choose, greedy: bool, *, ahead: bool = False
                    ) -> tuple[torch.Tensor, list[int], list[int]]:
        """walk(tree, choose(logits)): the target's choice at every node (logits [n, V]), then the
        walk. ahead (a next draft may follow) is for the fast path; nothing here runs ahead."""
        return self.walk(tree, choose(logits))

    def accepted_features(self, features: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
        """The accepted rows' features [len(path), W], for the next draft."""
        return features.index_select(0, path)

    def walk(self, tree: Tree, posterior: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
        """The accepted path (device), the same as a list, and the tokens it commits."""
        path = accepted_path(tree, posterior)
        new = torch.cat((tree.tokens[path[1:]], posterior[path[-1:]])).tolist()
        return path, path.tolist(), new
