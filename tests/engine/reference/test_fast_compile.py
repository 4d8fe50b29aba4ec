"""The fast backend's static path through torch.compile'd layers decodes the same tokens.

On CUDA the compiled layers run inside the captured graphs (FastPath.warmup); here, on a CPU,
inductor compiles the same layer function for the static padded path without graphs.
"""

import pytest
import torch

from ddtree.engine.reference.engine import Engine, GenParams, SpecParams

from .conftest import make_drafter, make_target

pytestmark = pytest.mark.slow


def test_compiled_static_path_decodes_like_the_reference():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = make_target(41)
    drafter = make_drafter(model, block_size=8)
    reference = Engine(model, drafter)
    fast = Engine(model, drafter, backend="fast", context_window=256, max_budget=32)
    fast.target.static = True
    fast.target.compile()
    gen = GenParams(max_new_tokens=20, ignore_eos=True)
    for prompt in ([3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 2]):
        ar = reference.generate(prompt, gen, SpecParams("ar"))
        for spec in (SpecParams("ar"), SpecParams("dflash"), SpecParams("ddtree", 16)):
            got = fast.generate(prompt, gen, spec)
            assert got.output_ids == ar.output_ids, spec
            if spec.algorithm != "ar":
                assert got.accept_lengths == reference.generate(prompt, gen, spec).accept_lengths
    # One compiled graph for single-token steps and one with a dynamic query length, shared by
    # every layer: regional compilation, not one compile per layer and shape.
    assert counters["stats"]["unique_graphs"] <= 3
    torch._dynamo.reset()


def test_compiled_drafter_block_equals_eager():
    from ddtree.engine.reference.fast.draft import FastDrafter, default_buckets

    torch._dynamo.reset()
    model = make_target(42)
    drafter = make_drafter(model, block_size=8, layers=2)
    fast = FastDrafter(drafter, model.model.embed_tokens, model.lm_head, capacity=64, mask_token_id=63)
    eager_cache, static_cache = fast.new_cache(), fast.new_cache(append_buckets=default_buckets(8))
    feats = torch.randn(12, drafter.fc.weight.shape[1])
    want = fast.draft(5, 12, feats, eager_cache, 7)
    fast.compile()
    got = fast.draft(5, 12, feats, static_cache, 7)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch._dynamo.reset()
