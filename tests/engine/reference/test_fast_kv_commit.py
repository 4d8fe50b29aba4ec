"""The fast backend's KV buckets, its walk+commit and its slot leases, on a CPU.

- The static path attends over the smallest KV bucket that holds the context (what the CUDA
  graphs of each (query bucket, KV bucket) run): its logits equal the full-window read and the
  eager path, in fp32, across bucket boundaries.
- After a static verify the walk also moves the accepted K/V rows (commit.py, one graph on CUDA):
  the same path, tokens and cache as walk_device + fetch_walk + compact.
- A session drawn from a slot that is dropped without close() gives the slot back once it is
  garbage-collected; close() gives it back at once, and only once.
"""

from __future__ import annotations

import gc

import pytest
import torch

from ddtree.engine.reference.engine import Engine, GenParams, SpecParams
from ddtree.engine.reference.fast.backend import decoder_from_hf
from ddtree.engine.reference.fast.cache import KV_MIN, StaticKVCache, kv_bucket, kv_buckets
from ddtree.engine.reference.fast.draft import default_buckets
from ddtree.engine.reference.fast.target import FastTarget
from ddtree.engine.reference.tree import build_tree_device, fetch_walk, walk_device

from .conftest import make_drafter, make_target

TOL = {"atol": 2e-5, "rtol": 2e-5}


def test_kv_buckets_double_from_the_minimum_and_end_at_the_rows():
    assert kv_buckets(640) == (256, 512, 640)
    assert kv_buckets(256) == (256,) and kv_buckets(100) == (100,)
    assert kv_buckets(9216) == (256, 512, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 9216)
    assert kv_buckets(2240) == (256, 512, 1024, 1536, 2048, 2240) and kv_buckets(1536) == (256, 512, 1024, 1536)
    assert kv_bucket(640, 1) == KV_MIN and kv_bucket(640, 256) == 256
    assert kv_bucket(640, 257) == 512 and kv_bucket(640, 513) == 640 and kv_bucket(640, 700) == 640


def _spans(monkeypatch, target: FastTarget) -> list[tuple[int, int]]:
    """Record (query rows, attended span) of every static forward."""
    seen = []
    forward = target.static_forward

    def recorded(ids, positions, tree, cache, kv=None, into=None):
        seen.append((int(ids.shape[0]), cache.rows if kv is None else int(kv)))
        return forward(ids, positions, tree, cache, kv, into)

    monkeypatch.setattr(target, "static_forward", recorded)
    return seen


def _rounds(target: FastTarget, seed: int, *, walk: bool) -> list:
    """Prefill 240 tokens, then tree verifies of 16 nodes with commits and one-token steps, until
    the context passes 300 rows: the attended span crosses the 256 bucket boundary. Returns the
    logits of every forward and the (path, new tokens) of every walk."""
    g = torch.Generator().manual_seed(seed)
    vocab = target.vocab_size
    out = []
    with torch.inference_mode():
        cache = target.new_cache()
        start = 240
        prompt = torch.randint(0, vocab, (start,), generator=g)
        out.append(target.forward(prompt, torch.arange(start), cache, features=True).logits)
        while start < 300:
            lp = torch.log_softmax(torch.randn(6, vocab, generator=g) * 3, -1)
            tree = build_tree_device(int(prompt[start % 7]), lp, 15)
            res = target.forward(tree.tokens, tree.depths + start, cache, target.tree_mask(tree), features=True)
            out.append(res.logits)
            # A posterior that accepts a few nodes: each node's own token at its parent, on one path.
            posterior = res.logits.argmax(-1)
            leaf = int(tree.depths.argmax())
            node = leaf
            while node != 0:
                parent = int(tree.parents[node])
                posterior[parent] = tree.tokens[node]
                node = parent
            last = target.take_verify(tree.size) if walk else None
            if last is not None:
                path, path_list, new = target.walk_commit(last, tree.parents, posterior)
            else:
                order, count = walk_device(tree, posterior)
                path, path_list, new = fetch_walk(tree, posterior, order, count)
            assert len(path_list) > 2  # rows really move
            cache.compact(start, path, path_list)
            out.append((path_list, new))
            start += len(path_list)
            step = target.forward(torch.tensor([new[-1]]), torch.tensor([start]), cache, features=True)
            out.append(step.logits)
            cache.compact(start, torch.tensor([0]), [0])
            start += 1
            out.append(cache.seq_length())
    return out


def _same(got: list, want: list) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        if isinstance(b, torch.Tensor):
            torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"forward {i}: {m}")
        else:
            assert a == b, f"step {i}: {a} != {b}"


def test_bucketed_attention_and_walk_commit_equal_the_full_window_and_eager(monkeypatch):
    decoder = decoder_from_hf(make_target(61, max_pos=512))
    kwargs = {"context_window": 512, "max_query": 16}
    eager = FastTarget(decoder, (1, 2), **kwargs)
    bucketed = FastTarget(decoder, (1, 2), static=True, **kwargs)
    full = FastTarget(decoder, (1, 2), static=True, **kwargs)
    full.bucket_kv = False
    spans = _spans(monkeypatch, bucketed)
    want = _rounds(eager, 3, walk=False)
    got = _rounds(bucketed, 3, walk=True)
    _same(got, want)
    _same(_rounds(full, 3, walk=True), want)
    _same(_rounds(bucketed, 3, walk=False), want)  # the plain compact after a static verify too
    rows = bucketed.new_cache().rows
    assert {kv for _, kv in spans} == {256, 512} and rows > 512  # both sides of the boundary
    assert {q for q, _ in spans} == {1, 17}  # 16 tree nodes pad to bucket 17


@pytest.mark.parametrize("max_path", [None, 5])
def test_walk_commit_moves_only_what_compact_would(max_path):
    """Rows below the verify and the accepted rows end where compact puts them; the cache's
    length and the skipped compact agree. With max_path (a drafter's block: 4 drafts deep here)
    the walk moves that many rows, and the verify's rows past them stay where they were."""
    decoder = decoder_from_hf(make_target(62, max_pos=512))
    target = FastTarget(decoder, (), static=True, context_window=512, max_query=32)
    g = torch.Generator().manual_seed(4)
    with torch.inference_mode():
        cache = target.new_cache()
        cache.max_path = max_path
        target.forward(torch.randint(0, 60, (20,), generator=g), torch.arange(20), cache)
        before = cache.k[:, :, :20].clone()
        tree = build_tree_device(5, torch.log_softmax(torch.randn(4, 64, generator=g) * 2, -1), 20)
        res = target.forward(tree.tokens, tree.depths + 20, cache, target.tree_mask(tree))
        verified = cache.k[:, :, 20:20 + tree.size].clone()
        verified_v = cache.v[:, :, 20:20 + tree.size].clone()
        posterior = res.logits.argmax(-1)
        node = int(tree.depths.argmax())
        while node:
            posterior[int(tree.parents[node])] = tree.tokens[node]
            node = int(tree.parents[node])
        order, count = walk_device(tree, posterior)
        want = fetch_walk(tree, posterior, order, count)
        last = target.take_verify(tree.size)
        assert last is not None and target.take_verify(tree.size) is None  # once
        path, path_list, new = target.walk_commit(last, tree.parents, posterior)
        assert path_list == want[1] and new == want[2] and path.tolist() == path_list
        assert cache.moved == (20, len(path_list))
        cache.compact(20, path, path_list)
        assert cache.seq_length() == 20 + len(path_list) and cache.moved is None
        torch.testing.assert_close(cache.k[:, :, :20], before, atol=0, rtol=0)
        torch.testing.assert_close(cache.k[:, :, 20:20 + len(path_list)], verified[:, :, path_list], atol=0, rtol=0)
        torch.testing.assert_close(cache.v[:, :, 20:20 + len(path_list)], verified_v[:, :, path_list], atol=0, rtol=0)
        if max_path is not None:
            assert len(path_list) <= max_path < tree.size
            torch.testing.assert_close(cache.k[:, :, 20 + max_path:20 + tree.size], verified[:, :, max_path:],
                                       atol=0, rtol=0)


def test_a_shared_cache_uses_the_same_buffers_and_starts_empty():
    cache = StaticKVCache(2, 1, 4, 32, slack=8)
    cache.set_length(10)
    other = cache.share()
    assert other.k is cache.k and other.length_t is cache.length_t and other.graphs is cache.graphs
    assert other.seq_length() == 0 and int(other.length_t) == 0


# ---- slots --------------------------------------------------------------------------------------
def _slotted(slots: int) -> Engine:
    model = make_target(63)
    drafter = make_drafter(model, block_size=8, seed=5)
    fast = Engine(model, drafter, backend="fast", max_budget=32)
    fast.target.static = True
    for _ in range(slots):
        fast.impl.add_slot(fast.target.new_cache(), fast.impl.drafts.new_cache(append_buckets=default_buckets(8)))
    return fast


def test_a_dropped_session_gives_its_slot_back_when_collected():
    fast = _slotted(1)
    gen = GenParams(max_new_tokens=12, ignore_eos=True)
    spec = SpecParams("ddtree", 16)
    sess = fast.start([3, 1, 4, 1, 5], gen, spec)
    sess.step()
    sess.step()
    assert fast.impl.slot_of(sess._cache) is not None and not fast.impl._free
    other = fast.start([2, 7, 1], gen, spec)  # no slot free: a cache of its own
    assert fast.impl.slot_of(other._cache) is None
    other.close()
    assert not fast.impl._free
    cycle = [sess]
    sess.cycle = cycle  # dropped inside a reference cycle, as an abandoned request may be
    del sess, cycle
    gc.collect()
    assert len(fast.impl._free) == 1 and not fast.impl._leases
    # The slot serves the next session with stale rows from the dropped one: same output.
    again = fast.start([2, 7, 1, 8], gen, spec)
    assert fast.impl.slot_of(again._cache) is not None
    while not again.done:
        again.step()
    model = make_target(63)
    ref = Engine(model, make_drafter(model, block_size=8, seed=5)).generate([2, 7, 1, 8], gen, spec)
    assert again.output_ids == ref.output_ids and again.accept_lengths == ref.accept_lengths
    assert len(fast.impl._free) == 1


@pytest.mark.parametrize("algorithm", ["ar", "ddtree"])
def test_close_gives_the_slot_back_once(algorithm):
    fast = _slotted(2)
    spec = SpecParams(algorithm, 8)
    sess = fast.start([1, 2, 3], GenParams(max_new_tokens=6, ignore_eos=True), spec)
    sess.step()
    cache = sess._cache
    assert (sess._draft_cache is None) == (algorithm == "ar")
    sess.close()
    assert len(fast.impl._free) == 2
    fast.impl.release(cache, None)  # a second release of the same lease changes nothing
    del cache
    gc.collect()
    assert len(fast.impl._free) == 2 and len({id(p) for p in fast.impl._free}) == 2


def test_graph_lookup_takes_the_smallest_query_bucket_and_kv_span_that_fit():
    """What forward replays on CUDA, checked with stand-in graphs (capture's bookkeeping)."""
    target = FastTarget(decoder_from_hf(make_target(64, max_pos=512)), context_window=512, max_query=16)
    cache = target.new_cache()
    spans = kv_buckets(cache.rows)
    assert spans == (256, 512, cache.rows)
    for q in target.buckets:
        cache.stages[q] = None
        for kv in spans:
            if kv >= q:
                cache.graphs[(q, kv)] = (q, kv)
                cache.spans.setdefault(q, []).append(kv)
    shared = cache.share()
    for length, n, want in [(0, 1, (1, 256)), (255, 1, (1, 256)), (256, 1, (1, 512)), (250, 16, (17, 512)),
                            (239, 16, (17, 256)), (511, 2, (2, cache.rows)), (cache.rows - 3, 3, (3, cache.rows))]:
        shared.set_length(length)
        q, graph = target._graph_for(shared, n)
        assert graph == want and q == want[0], (length, n)
    shared.set_length(cache.rows - 2)
    assert target._graph_for(shared, 3) is None  # no room for the bucket: the eager path
    assert target._graph_for(target.new_cache(), 1) is None  # nothing captured
