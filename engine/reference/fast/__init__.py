"""The fast backend for dense pure-attention decoders: our own forward, a static KV cache, CUDA graphs.

    target = load_fast_target("assets/demo/target", device="cuda", feature_layers=(1, 4))
    cache = target.new_cache()
    target.capture(cache)              # optional, CUDA only: one graph per query bucket
    out = target.forward(ids, positions, cache, target.tree_mask(tree, start), features=True)

`unsupported_reason(config_dict)` says why a checkpoint cannot run here (then use the
transformers backend, target.Target).
"""
