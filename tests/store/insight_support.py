"""Synthetic points for the insight tests: just the attributes the store's readers use."""

from types import SimpleNamespace


def point(algorithm, budget, repeat, tok, *, concurrency=1, tp=1, tau=None, hist=None, state="done"):
    return SimpleNamespace(state=state, output_tok_s=tok, algorithm=algorithm, budget=budget, repeat=repeat,
                           engine_kind="builtin", tp=tp, gpus=[], concurrency=concurrency, dataset="builtin:code",
                           temperature=0.0, baseline=algorithm in ("ar", "dflash"), repeat_spread=None, error=None,
                           contended=None, req_s=None, tok_s_per_user=None, tau_mean=tau, tau_weighted=tau,
                           tau_counters=None, ttft_p50=None, itl_p50=None, e2e_p50=None, e2e_p99=None,
                           tau_hist=hist, max_new_tokens=128, cell_key=f'{{"a":"{algorithm}","b":{budget},"c":{concurrency}}}')


def points(cells: dict, **kw) -> list:
    """{(algorithm, budget): [tok/s per repeat]} -> points, repeat i numbered i."""
    return [point(alg, budget, i, tok, **kw) for (alg, budget), toks in cells.items() for i, tok in enumerate(toks)]
