"""The walk and the commit of a static verify, in one graph-ready function.

After the verify of n tree nodes (padded to a query bucket q) at rows start..start+q-1, and the
target's choice at each node (`posterior`), this finds the accepted path as tree.walk_device
does, packs (count, order, new tokens) as tree.fetch_walk does, and moves the K/V rows of the
accepted nodes to start..start+count-1 (StaticKVCache.compact's move) in the same pass, and sets
the cache's device length to start+count (compact's crop).

Every shape follows from q; n and the context length are read on the device (`count` and the
cache's length_t), so one CUDA graph per query bucket serves every round. The row move gathers
the first rows of the walk order (all q, or the cache's max_path): the accepted ones land where
compact would put them, and the rest land past the new length, where no query reads them.
Padded nodes carry no real token: they are never matched, so never accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree.engine.reference.tree import partition


@dataclass
class WalkIO:
    """One query bucket's walk buffers on one cache (graphs bake in their addresses)."""
    posterior: torch.Tensor   # [q] long (input): the target's choice at each node
    parents: torch.Tensor     # [q] long (input): each node's parent (padded rows: any node)
    count: torch.Tensor       # 0-dim long (input): n, the real nodes
    arange: torch.Tensor      # [q] long
    packed: torch.Tensor      # [1 + 2q] long (output): count, order [q], new tokens [q]
    greedy: torch.Tensor      # 0-dim bool (input): take the argmax of the verify's logits, not posterior
    graph: object = None      # the captured walk, or None (run walk_commit_static)
    sink: torch.Tensor | None = None  # the feature sink the captured walk writes (see capture)
    draft_next: tuple | None = None   # the drafter's (count, ids, cache) the captured walk writes
    # What the device inputs hold now (None: unknown), so a round refills only what changed.
    count_set: int | None = None
    greedy_set: bool | None = None


def new_walk_io(q: int, device) -> WalkIO:
    return WalkIO(posterior=torch.zeros(q, dtype=torch.long, device=device),
                  parents=torch.zeros(q, dtype=torch.long, device=device),
                  count=torch.zeros((), dtype=torch.long, device=device),
                  arange=torch.arange(q, device=device),
                  packed=torch.zeros(1 + 2 * q, dtype=torch.long, device=device),
                  greedy=torch.zeros((), dtype=torch.bool, device=device))


def set_walk_inputs(io: WalkIO, n: int, greedy: bool) -> None:
    """Fill the walk's count and greedy flag, skipping a fill whose value is already there
    (a session's rounds at one budget verify the same n, so most rounds fill neither)."""
    if io.count_set != n:
        io.count.fill_(n)
        io.count_set = n
    if io.greedy_set != greedy:
        io.greedy.fill_(greedy)
        io.greedy_set = greedy


def walk_commit_static(tokens: torch.Tensor, visible: torch.Tensor, io: WalkIO, cache,
                       logits: torch.Tensor | None = None, features: torch.Tensor | None = None,
                       sink: torch.Tensor | None = None, draft_next: tuple | None = None) -> None:
    """tokens [q] (the verify's ids), visible [q, q] bool (its ancestor matrix, padded rows see
    themselves only); writes io.packed and moves the cache's accepted rows. No host sync.

    logits [q, V] (the verify's): where io.greedy is set, the target's choice is their argmax
    (taken here, so a greedy round launches no argmax of its own) instead of io.posterior.
    features [q, W] and sink [r, W]: the features of the first r rows in walk order go to the
    sink (the drafter's staging rows, fast/draft.py), the accepted ones first, so the next draft
    reads them where they are. draft_next: the drafter's append count (0-dim long), block ids
    [B] long and the cache they belong to (FastPath's, for the draft ahead); the first two get the accepted count and the bonus: with the sink, everything the next
    draft step reads, so it can be launched before the host has read this walk (a draft ahead,
    backend.py)."""
    q = int(tokens.shape[0])
    idx = io.arange
    real = idx < io.count
    posterior = io.posterior
    if logits is not None:
        posterior = torch.where(io.greedy, logits.argmax(dim=-1), posterior)
    matched = (tokens == posterior.index_select(0, io.parents)) & real
    matched = matched | (idx == 0)                            # the root is the committed bonus
    ok = ~(visible & ~matched[None, :]).any(dim=1)
    order, _, count = partition(ok)
    last = order.gather(0, (count - 1).reshape(1))
    bonus = posterior.index_select(0, last)
    after = torch.cat((tokens.index_select(0, order[1:]), bonus))
    new = torch.where(idx == count - 1, bonus, after)         # the last step commits the bonus
    io.packed[:1].copy_(count.reshape(1))
    io.packed[1:1 + q].copy_(order)
    io.packed[1 + q:].copy_(new)
    # The rows: start+order[i] -> start+i (index_select reads them all first), for the first
    # max_path of the walk order: the accepted ones are among them, and nothing past the new
    # length is read. At budget 256 with a 16-token block: 16 rows a layer, not 257.
    start = cache.length_t - io.count
    rows = q if cache.max_path is None else min(q, cache.max_path)
    src = start + order[:rows]
    dst = start + idx[:rows]
    cache.k.index_copy_(2, dst, cache.k.index_select(2, src))
    cache.v.index_copy_(2, dst, cache.v.index_select(2, src))
    # The context now ends after the accepted rows (compact then sets only the host length).
    # With no real nodes (a capture's warm-up) it stays where it was.
    cache.length_t.copy_(torch.where(io.count > 0, start + count, cache.length_t))
    if sink is not None and features is not None:
        rows = min(q, int(sink.shape[0]))
        sink[:rows].copy_(features.index_select(0, order[:rows]))
    if draft_next is not None:
        real = io.count > 0  # a capture's warm-up has no real nodes: leave the drafter's inputs
        next_count, next_ids = draft_next[:2]
        next_count.copy_(torch.where(real, count, next_count))
        next_ids[:1].copy_(torch.where(real, bonus, next_ids[:1]))
