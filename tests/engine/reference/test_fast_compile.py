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


def test_swapped_few_row_products_decode_like_the_reference_compiled_or_not():
    """The target's layers with every few-row product swapped (what RowLinears picks where cuBLAS
    is slow in float32 on CUDA, forced here on the CPU), on the eager and the compiled static
    path: the same tokens as the transformers reference."""
    torch._dynamo.reset()
    model = make_target(43)
    drafter = make_drafter(model, block_size=8)
    reference = Engine(model, drafter)
    gen = GenParams(max_new_tokens=16, ignore_eos=True)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    for compiled in (False, True):
        fast = Engine(model, drafter, backend="fast", context_window=128, max_budget=16)
        tuned = fast.target.model.tune_linears()
        assert tuned.swap == set()  # nothing is measured on a CPU
        layer = fast.target.model.model.layers[0]
        weights = [layer.self_attn.qkv[0], layer.self_attn.o_proj.weight, layer.mlp.gate_up[0],
                   layer.mlp.down_proj.weight]
        tuned.swap = {(m, w.shape[1], w.shape[0]) for w in weights for m in range(1, 17)}
        if compiled:
            fast.target.static = True
            fast.target.compile()
        for spec in (SpecParams("ar"), SpecParams("dflash"), SpecParams("ddtree", 8)):
            want = reference.generate(prompt, gen, spec)
            got = fast.generate(prompt, gen, spec)
            assert got.output_ids == want.output_ids, (compiled, spec)
            assert got.accept_lengths == want.accept_lengths, (compiled, spec)
    torch._dynamo.reset()
