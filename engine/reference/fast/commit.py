"""The walk and the commit of a static verify, in one graph-ready function.

After the verify of n tree nodes (padded to a query bucket q) at rows start..start+q-1, and the
target's choice at each node (`posterior`), this finds the accepted path as tree.walk_device
does, packs (count, order, new tokens) as tree.fetch_walk does, and moves the K/V rows of the
accepted nodes to start..start+count-1 (StaticKVCache.compact's move) in the same pass.

Every shape follows from q; n and the context length are read on the device (`count` and the
cache's length_t), so one CUDA graph per query bucket serves every round. The row move gathers
all q rows in walk order: the accepted ones land where compact would put them, and the rest
land past the new length, where no query reads them. Padded nodes carry no real token: they are
never matched, so never accepted.
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
    graph: object = None      # the captured walk, or None (run walk_commit_static)


def new_walk_io(q: int, device) -> WalkIO:
    return WalkIO(posterior=torch.zeros(q, dtype=torch.long, device=device),
                  parents=torch.zeros(q, dtype=torch.long, device=device),
                  count=torch.zeros((), dtype=torch.long, device=device),
                  arange=torch.arange(q, device=device),
                  packed=torch.zeros(1 + 2 * q, dtype=torch.long, device=device))


def walk_commit_static(tokens: torch.Tensor, visible: torch.Tensor, io: WalkIO, cache) -> None:
    """tokens [q] (the verify's ids), visible [q, q] bool (its ancestor matrix, padded rows see
    themselves only); writes io.packed and moves the cache's accepted rows. No host sync."""
    q = int(tokens.shape[0])
    idx = io.arange
    real = idx < io.count
    matched = (tokens == io.posterior.index_select(0, io.parents)) & real
    matched = matched | (idx == 0)                            # the root is the committed bonus
    ok = ~(visible & ~matched[None, :]).any(dim=1)
    order, _, count = partition(ok)
    last = order.gather(0, (count - 1).reshape(1))
    bonus = io.posterior.index_select(0, last)
    after = torch.cat((tokens.index_select(0, order[1:]), bonus))
    new = torch.where(idx == count - 1, bonus, after)         # the last step commits the bonus
    io.packed[:1].copy_(count.reshape(1))
    io.packed[1:1 + q].copy_(order)
    io.packed[1 + q:].copy_(new)
    # The rows: start+order[i] -> start+i for all q (index_select reads them all first).
    start = cache.length_t - io.count
    src = start + order
    dst = start + idx
    cache.k.index_copy_(2, dst, cache.k.index_select(2, src))
    cache.v.index_copy_(2, dst, cache.v.index_select(2, src))
