"""The fast backend's static path through torch.compile'd layers decodes the same tokens.

On CUDA the compiled layers run inside the graphs FastPath.warmup captures, and only during the
warm-up (graphs.warming_up): here, on a CPU, inductor compiles the same layer function for the
static padded path, inside graphs.warmup_scope() as the warm-up's captures would.
"""

import pytest
import torch

from ddtree.engine.reference.engine import Engine, GenParams, SpecParams
from ddtree.engine.reference.fast.graphs import warmup_scope

from .conftest import make_drafter, make_target

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("attention", ["auto", "triton"])
def test_compiled_static_path_decodes_like_the_reference(attention, monkeypatch):
    """triton: the CUDA configuration in small, the kernels in Triton's interpreter: tree
    attention, rope_write's in-place cache writes and every one-row product on the GEMV kernel,
    all inside the compiled layer."""
    from torch._dynamo.utils import counters

    from ddtree.engine.reference.fast import gemv, rope_write, tree_attention
    from ddtree.engine.reference.fast.gemv import Config

    if attention == "triton" and not (tree_attention.available() and tree_attention.interpreting()):
        pytest.skip("needs triton's interpreter")
    torch._dynamo.reset()
    counters.clear()
    model = make_target(41)
    drafter = make_drafter(model, block_size=8)
    reference = Engine(model, drafter)
    fast = Engine(model, drafter, backend="fast", context_window=256, max_budget=32, attention=attention)
    fast.target.static = True
    if attention == "triton":
        decoder = fast.target.model
        layer = decoder.model.layers[0]
        for w in (layer.self_attn.qkv[0], layer.self_attn.o_proj.weight, layer.mlp.gate_up[0],
                  layer.mlp.down_proj.weight, decoder.lm_head.weight):
            decoder.gemv.picked[tuple(w.shape)] = Config(4, 32, 4, 2)
    ran = {"gemv": 0, "rope_write": 0}
    for module in (gemv, rope_write):
        real = module.launch
        name = module.__name__.rsplit(".", 1)[1]
        monkeypatch.setattr(module, "launch", lambda *a, real=real, name=name: ran.__setitem__(name, ran[name] + 1) or real(*a))
    fast.target.compile()
    # The interpreter is slow: the triton case decodes less (its kernels are also checked alone).
    small = attention == "triton"
    gen = GenParams(max_new_tokens=8 if small else 20, ignore_eos=True)
    prompts = ([3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 2])[:1 if small else 2]
    specs = (SpecParams("ar"), SpecParams("ddtree", 16)) if small else (SpecParams("ar"), SpecParams("dflash"),
                                                                      SpecParams("ddtree", 16))
    for prompt in prompts:
        ar = reference.generate(prompt, gen, SpecParams("ar"))
        for spec in specs:
            with warmup_scope():
                got = fast.generate(prompt, gen, spec)
            assert got.output_ids == ar.output_ids, spec
            if spec.algorithm != "ar":
                assert got.accept_lengths == reference.generate(prompt, gen, spec).accept_lengths
    # One compiled graph for single-token steps and one with a dynamic query length, shared by
    # every layer: regional compilation, not one compile per layer and shape.
    assert 1 <= counters["stats"]["unique_graphs"] <= 3
    if attention == "triton":
        assert ran["gemv"] and ran["rope_write"], ran
    # Past the warm-up nothing compiles, whatever the shape: serving never waits for inductor.
    torch._dynamo.reset()
    counters.clear()
    assert fast.generate([5, 5, 5, 2, 1], gen, SpecParams("ddtree", 16)).output_ids == \
        reference.generate([5, 5, 5, 2, 1], gen, SpecParams("ar")).output_ids
    assert counters["stats"]["unique_graphs"] == 0
    torch._dynamo.reset()


def test_compiled_drafter_block_equals_eager():
    from torch._dynamo.utils import counters

    from ddtree.engine.reference.fast.draft import FastDrafter, default_buckets

    torch._dynamo.reset()
    counters.clear()
    model = make_target(42)
    drafter = make_drafter(model, block_size=8, layers=2)
    fast = FastDrafter(drafter, model.model.embed_tokens, model.lm_head, capacity=64, mask_token_id=63)
    eager_cache, static_cache = fast.new_cache(), fast.new_cache(append_buckets=default_buckets(8))
    feats = torch.randn(12, drafter.fc.weight.shape[1])
    want = fast.draft(5, 12, feats, eager_cache, 7)
    fast.compile()
    with warmup_scope():
        got = fast.draft(5, 12, feats, static_cache, 7)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert counters["stats"]["unique_graphs"] >= 1
    torch._dynamo.reset()
    counters.clear()
    torch.testing.assert_close(fast.draft(5, 12, feats, fast.new_cache(append_buckets=default_buckets(8)), 7),
                               want, atol=1e-4, rtol=1e-4)
    assert counters["stats"]["unique_graphs"] == 0  # past the warm-up the block runs uncompiled
    torch._dynamo.reset()
