import inspect
import warnings

import pytest
import torch

from ddtree.engine.reference.target import KVCache, Target, hybrid_reason
from ddtree.engine.reference.tree import build_tree, tree_attention_mask

from .conftest import make_drafter, make_target


def _plain_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


def _node_paths(tree) -> list[list[int]]:
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    out = []
    for i in range(tree.size):
        path, j = [tokens[i]], i
        while j != 0:
            j = parents[j]
            path.append(tokens[j])
        out.append(list(reversed(path)))
    return out


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("with_cache", [True, False])
def test_tree_node_logits_equal_a_causal_forward_over_the_path(attn, with_cache):
    model = make_target(3, attn=attn)
    target = Target(model, (1, 2))
    context = [3, 14, 15, 9, 26, 5, 35]
    tree = build_tree(8, torch.log_softmax(torch.randn(5, 64, generator=torch.Generator().manual_seed(1)), -1), 24)
    assert not tree.is_chain
    with torch.inference_mode():
        cache = target.new_cache()
        if with_cache:
            target.forward(torch.tensor(context), torch.arange(len(context)), cache)
            ids, pos, start = tree.tokens, tree.depths + len(context), len(context)
            mask = tree_attention_mask(tree, start, torch.float32)
        else:
            # Context and tree in one forward: a causal block over the context, then the tree.
            start = len(context)
            ids = torch.cat((torch.tensor(context), tree.tokens))
            pos = torch.cat((torch.arange(start), tree.depths + start))
            n = ids.shape[0]
            mask = torch.full((n, n), torch.finfo(torch.float32).min)
            mask[:start, :start] = torch.triu(mask[:start, :start], diagonal=1)
            mask[start:] = tree_attention_mask(tree, start, torch.float32)[0, 0]
            mask = mask[None, None]
        out = target.forward(ids, pos, cache, mask, features=True)
        logits = out.logits[-tree.size:]
        for i, path in enumerate(_node_paths(tree)):
            want = _plain_logits(model, context + path)[-1]
            torch.testing.assert_close(logits[i], want, atol=2e-4, rtol=1e-4)
    assert out.features.shape == (ids.shape[0], 2 * model.config.hidden_size)


def test_compact_keeps_exactly_the_accepted_rows():
    model = make_target(4)
    target = Target(model)
    context = [1, 2, 3, 4, 5]
    tree = build_tree(6, torch.log_softmax(torch.randn(4, 64, generator=torch.Generator().manual_seed(2)), -1), 20)
    paths = _node_paths(tree)
    leaf = max(range(tree.size), key=lambda i: (int(tree.depths[i]), i))  # a deep, late node
    keep = [0]
    j = leaf
    while j != 0:
        keep.insert(1, j)
        j = int(tree.parents[j])
    assert keep != list(range(len(keep)))  # the interesting case: rows move
    with torch.inference_mode():
        cache = target.new_cache()
        target.forward(torch.tensor(context), torch.arange(5), cache)
        target.forward(tree.tokens, tree.depths + 5, cache, tree_attention_mask(tree, 5, torch.float32))
        cache.compact(5, torch.tensor(keep), keep)
        assert cache.seq_length() == 5 + len(keep)
        nxt = 11
        got = target.forward(torch.tensor([nxt]), torch.tensor([5 + len(keep)]), cache).logits[0]
        want = _plain_logits(model, context + paths[leaf] + [nxt])[-1]
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
        fresh = target.new_cache()
        target.forward(torch.tensor(context + paths[leaf]), torch.arange(5 + len(keep)), fresh)
        for (k1, v1), (k2, v2) in zip(_kv(cache), _kv(fresh)):
            torch.testing.assert_close(k1[..., :5 + len(keep), :], k2, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v1[..., :5 + len(keep), :], v2, atol=1e-5, rtol=1e-5)


def _kv(cache: KVCache):
    return [cache._get(entry) for entry in cache._pairs()]


def test_crop_and_legacy_cache_layout():
    class Legacy:  # transformers before 5.x: parallel key_cache/value_cache lists
        def __init__(self):
            self.key_cache = [torch.randn(1, 2, 10, 4) for _ in range(3)]
            self.value_cache = [torch.randn(1, 2, 10, 4) for _ in range(3)]

        def get_seq_length(self):
            return self.key_cache[0].shape[-2]

    legacy = Legacy()
    row = legacy.key_cache[1][..., 7, :].clone()
    cache = KVCache(legacy)
    cache.compact(4, torch.tensor([0, 3]), [0, 3])
    assert cache.seq_length() == 6
    torch.testing.assert_close(legacy.key_cache[1][..., 5, :], row)
    cache.crop(2)
    assert cache.seq_length() == 2


def test_cache_argument_name_follows_the_installed_transformers():
    model = make_target(0, layers=2)
    target = Target(model)
    params = inspect.signature(model.forward).parameters
    assert target.cache_kwarg == ("cache" if "cache" in params else "past_key_values")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the deprecated name would warn on 5.24+
        with torch.inference_mode():
            target.forward(torch.tensor([1, 2, 3]), torch.arange(3), target.new_cache())


def test_hybrid_detection():
    from transformers import Qwen3Config

    assert hybrid_reason(Qwen3Config(num_hidden_layers=2)) is None
    cfg = Qwen3Config(num_hidden_layers=4)
    cfg.layer_types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    assert "linear_attention" in hybrid_reason(cfg)
    cfg2 = Qwen3Config(num_hidden_layers=2)
    cfg2.model_type = "qwen3_next"
    cfg2.layer_types = None
    assert "qwen3_next" in hybrid_reason(cfg2)
    # the torch-free module is the one home; target.py re-exports it
    from ddtree.engine import arch

    assert hybrid_reason is arch.hybrid_reason


def test_hybrid_target_logs_once_that_it_runs_ar_only(caplog):
    from ddtree.engine.reference.engine import Engine

    model = make_target(0, layers=4)
    model.config.layer_types = ["full_attention", "mamba", "full_attention", "mamba"]
    with caplog.at_level("WARNING", logger="ddtree.engine.reference.engine"):
        engine = Engine(model, make_drafter(model))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0] == engine.hybrid_warning
    assert "mamba" in engine.hybrid_warning and "ar only" in engine.hybrid_warning
    assert "collapse" not in engine.hybrid_warning  # the output would be wrong, not just slower
    model.config.layer_types = ["full_attention"] * 4
    assert Engine(model, make_drafter(model)).hybrid_warning is None
