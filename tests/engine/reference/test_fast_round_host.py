"""A fast-backend round's host work, on the slot path that CUDA graphs capture (run on a CPU).

The slot path stages what the next step reads where it will read it: the walk takes the greedy
argmax itself and writes the accepted features into the drafter's staging rows; the draft step
(append + block) is one function and the tree build reads the draft output in place. These
tests hold that path to the reference's tokens, and count the tensor ops a round runs outside
the functions the graphs capture (what a GPU launches one by one).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes

from ddtree.engine.reference import tree as tree_mod
from ddtree.engine.reference.engine import Engine, GenParams, SpecParams
from ddtree.engine.reference.fast import backend as backend_mod
from ddtree.engine.reference.fast import commit as commit_mod
from ddtree.engine.reference.fast import target as target_mod
from ddtree.engine.reference.fast.draft import FastDrafter, default_buckets
from ddtree.engine.reference.fast.probe import HostWork
from ddtree.engine.reference.fast.target import FastTarget

from .conftest import make_drafter, make_target

PROMPTS = ([3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8], [5, 5, 5, 1])


def _fast(slots: int, seed: int = 63) -> Engine:
    model = make_target(seed)
    fast = Engine(model, make_drafter(model, block_size=8, seed=5), backend="fast", max_budget=32)
    fast.target.static = True
    for _ in range(slots):
        fast.impl.add_slot(fast.target.new_cache(), fast.impl.drafts.new_cache(append_buckets=default_buckets(8)))
    return fast


@pytest.mark.parametrize("spec", [SpecParams("dflash"), SpecParams("ddtree", 1), SpecParams("ddtree", 7),
                                  SpecParams("ddtree", 16), SpecParams("ddtree", 32)],
                         ids=lambda s: f"{s.algorithm}-{s.budget}")
def test_the_slot_path_decodes_what_the_reference_decodes(spec):
    fast = _fast(1)
    model = make_target(63)
    ref = Engine(model, make_drafter(model, block_size=8, seed=5))
    gen = GenParams(max_new_tokens=40, ignore_eos=True)
    for prompt in PROMPTS:
        sess = fast.start(prompt, gen, spec)
        assert fast.impl.slot_of(sess._cache) is not None
        assert sess._cache.max_path == 8  # so the walks below move at most the block's 8 rows
        while not sess.done:
            sess.step()
        want = ref.generate(prompt, gen, spec)
        assert sess.output_ids == want.output_ids and sess.accept_lengths == want.accept_lengths


def test_sampling_on_the_slot_path_equals_the_path_without_slots():
    """At T > 0 the walk takes the sampled choices (no in-walk argmax) and the features still
    come through the drafter's staging rows: the same seeded tokens as a cache of its own."""
    gen = GenParams(max_new_tokens=30, ignore_eos=True, temperature=0.9, top_p=0.95, seed=7)
    spec = SpecParams("ddtree", 16)
    slotted, plain = _fast(1), _fast(0)
    for prompt in PROMPTS:
        a = slotted.generate(prompt, gen, spec)
        b = plain.generate(prompt, gen, spec)
        assert a.output_ids == b.output_ids and a.accept_lengths == b.accept_lengths


def _hide_graph_bound(monkeypatch) -> None:
    """Run what the graphs capture outside the counting mode (on CUDA it is one replay each)."""
    def hidden(fn):
        def run(*args, **kwargs):
            with _disable_current_modes():
                return fn(*args, **kwargs)
        return run
    for owner, name in ((FastTarget, "static_forward"), (FastTarget, "stage_tree"), (FastDrafter, "_draft_static"),
                        (FastDrafter, "_append_static"), (FastDrafter, "_block_static"),
                        (target_mod, "walk_commit_static"), (backend_mod, "build_tree_device"),
                        (backend_mod, "chain_of")):
        monkeypatch.setattr(owner, name, hidden(getattr(owner, name)))
    # On a CPU the tree build's log_softmax runs outside build_tree_device; the graph holds it.
    monkeypatch.setattr(backend_mod.torch, "log_softmax", hidden(torch.log_softmax), raising=True)


@pytest.mark.parametrize("spec", [SpecParams("ddtree", 16), SpecParams("dflash")], ids=["ddtree", "dflash"])
def test_a_greedy_round_launches_a_handful_of_ops_and_no_copy_of_the_logits(monkeypatch, spec):
    fast = _fast(1)
    sess = fast.start(list(range(5, 40)), GenParams(max_new_tokens=60, ignore_eos=True), spec)
    for _ in range(3):
        sess.step()
    _hide_graph_bound(monkeypatch)
    counts = []
    for _ in range(3):
        with HostWork() as work:
            sess.step()
        counts.append(work)
    for work in counts:
        # The tree build writes the verify's inputs and the walk's parents, the walk the next
        # draft's features and the context length: left are the draft's bonus and count and
        # the verify's context length. No clone, argmax, index_select or cat.
        assert work.launches <= 4, work.ops
        assert not {"clone", "argmax", "index_select", "cat", "log_softmax"} & set(work.ops), work.ops
        assert work.h2d == 0


def test_host_work_counts_launches_syncs_and_host_copies():
    x = torch.arange(6.0)
    with HostWork() as work:
        y = x * 2
        y.view(2, 3).sum(dim=1)
        float(y[0])
    assert work.launches == 2 and work.syncs == 1 and work.as_dict()["host_syncs"] == 1
    assert tree_mod.partition and commit_mod.walk_commit_static  # the names the graphs capture


def test_compile_raises_dynamos_recompile_limit_to_cover_every_captured_shape(monkeypatch):
    from ddtree.engine.reference.fast.cache import kv_buckets

    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 8)
    fast = _fast(0)
    target = fast.target
    assert target.new_cache_rows() == target.new_cache().rows
    monkeypatch.setattr(target.model, "compile_layers", lambda: None)  # no compiler needed here
    target.compile()
    shapes = len(target.buckets) * len(kv_buckets(target.new_cache_rows()))
    assert torch._dynamo.config.recompile_limit >= shapes > 8
