"""The fast backend on CUDA with its graphs captured (engine.warmup()): the identity checks of
test_fast_engine.py in fp32, and in bf16 the check that every divergence from AR is a true
near-tie at bf16 resolution (issue 21, item 5). Run on the H200 by the lead; skipped without CUDA.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ddtree.engine.reference.engine import Engine, GenParams, SpecParams
from ddtree.engine.reference.fast.cache import kv_buckets

from .conftest import make_drafter, make_target
from .test_fast_engine import _compare as compare_backends

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROOT = Path(__file__).resolve().parents[3]
DEMO_TARGET = ROOT / "assets" / "demo" / "target"
DEMO_DRAFTER = ROOT / "assets" / "demo" / "drafter"
PROMPTS = ROOT / "assets" / "prompts" / "code.jsonl"
AR = SpecParams("ar")
SPECS = [AR, SpecParams("dflash"), SpecParams("ddtree", 16), SpecParams("ddtree", 64), SpecParams("ddtree", 256)]
BF16_ULP = 2.0 ** -7  # bf16 keeps 8 significant bits: neighbours differ by 2^-7 of the magnitude


def _tiny_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 60, (n,), generator=g).tolist() for n in (1, 7, 23, 41)]


def _demo_prompts(tokenizer, n: int) -> list[list[int]]:
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    return [tokenizer.encode(r["prompt"]) for r in rows if r.get("split") == "heldout"][:n]


def _need_demo() -> None:
    if not (DEMO_TARGET / "config.json").is_file():
        pytest.skip("the demo pair is not in assets/demo")


def _compare(ref: Engine, fast: Engine, prompts, gen: GenParams, specs=SPECS) -> int:
    return compare_backends(ref, fast, prompts, gen, specs)


def _warm(engine: Engine) -> Engine:
    engine.warmup()
    assert engine.graphs is True
    return engine


@pytest.fixture(scope="module")
def tiny():
    model = make_target(41).to("cuda")
    drafter = make_drafter(model, block_size=8, seed=4)
    ref = Engine(model, drafter, backend="transformers", max_budget=256)
    fast = Engine(model, drafter, backend="fast", max_budget=256)
    assert not fast.graphs
    return ref, _warm(fast)


def test_graphs_tiny_target_fp32_equal_ar_and_transformers(tiny):
    ref, fast = tiny
    sess = fast.start([1, 2, 3], GenParams(max_new_tokens=4, ignore_eos=True), SpecParams("ddtree", 16))
    assert sess._cache.graphs  # a slot whose graphs were captured by warmup
    sess.close()
    assert _compare(ref, fast, _tiny_prompts(), GenParams(max_new_tokens=24, ignore_eos=True)) > 0
    # A short block and a length cut mid-round, with graphs.
    fast.block_size = ref.block_size = 4
    try:
        _compare(ref, fast, _tiny_prompts()[1:3], GenParams(max_new_tokens=11, ignore_eos=True), SPECS[:4])
    finally:
        fast.block_size = ref.block_size = 8


def test_warmup_captures_the_tree_builds_of_every_draft_depth():
    """A request's last rounds draft shallower (Session._depth_cap); none of those depths may
    capture a tree build (and compile its kernel) mid-generation."""
    model = make_target(41).to("cuda")
    drafter = make_drafter(model, block_size=8, seed=4)
    fast = Engine(model, drafter, backend="fast", max_budget=64)
    fast.warmup(budgets=(16,))
    captured = set(fast.impl._trees)
    depth = fast.block_size - 1
    assert {(16, d, 0) for d in range(1, depth + 1)} <= captured
    for spec in (SpecParams("ddtree", 16), SpecParams("dflash")):
        for n in (5, 13, 30):
            fast.generate([1, 2, 3, 4], GenParams(max_new_tokens=n, ignore_eos=True), spec)
    assert set(fast.impl._trees) == captured


def test_graphs_sessions_beyond_the_slots_equal_serial(tiny):
    ref, fast = tiny
    slots = fast.impl.slots
    specs = [SpecParams("ddtree", 16), AR, SpecParams("dflash"), SpecParams("ddtree", 64),
             SpecParams("ddtree", 256), SpecParams("dflash")]
    g = torch.Generator().manual_seed(9)
    jobs = [(torch.randint(0, 60, (3 + 5 * i,), generator=g).tolist(),
             GenParams(max_new_tokens=13 + 3 * i, ignore_eos=True), spec) for i, spec in enumerate(specs)]
    assert len(jobs) > slots
    serial = [ref.generate(*job) for job in jobs]
    sessions = [fast.start(*job) for job in jobs]
    pooled = [fast.impl.slot_of(s._cache) is not None for s in sessions]
    assert sum(pooled) == slots and not all(pooled)  # the rest run eagerly on caches of their own
    sessions[1].step()
    sessions[1].close()  # a client that went away early
    while not all(s.done for s in sessions):
        for s in sessions:
            s.step()
        live = [s for s in sessions if not s.done]
        assert len({id(s._cache) for s in live}) == len(live)
    for i, (s, want) in enumerate(zip(sessions, serial)):
        n = len(s.accept_lengths)
        assert s.output_ids == want.output_ids[:len(s.output_ids)], i
        assert s.accept_lengths == want.accept_lengths[:n], i
        if i != 1:
            assert s.output_ids == want.output_ids, i
    assert len(fast.impl._free) == slots


def test_graphs_across_kv_buckets_and_walk_graphs_equal_transformers(tiny, monkeypatch):
    """A context that grows from 240 past 256 and 512 rows: the replays move to larger KV spans
    (one graph per query and KV bucket; one per query bucket with the triton kernel, which reads
    the context's rows itself) and every verify commits through its walk graph."""
    ref, fast = tiny
    target = fast.target
    used: set = set()
    find = target._graph_for

    def spy(cache, n):
        found = find(cache, n)
        if found is not None:
            used.add(next(key for key, graph in cache.graphs.items() if graph is found[1]))
        return found

    walks = []
    walk_commit = target.walk_commit

    def counted(last, parents, posterior, **kwargs):
        io = last.cache().walks[last.q]
        walks.append(io.graph is not None)
        return walk_commit(last, parents, posterior, **kwargs)

    monkeypatch.setattr(target, "_graph_for", spy)
    monkeypatch.setattr(target, "walk_commit", counted)
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, 60, (240,), generator=g).tolist()
    gen = GenParams(max_new_tokens=300, ignore_eos=True)
    assert _compare(ref, fast, [prompt], gen, [AR, SpecParams("dflash"), SpecParams("ddtree", 64)]) > 0
    cache = fast.impl._slots[0][0]
    spans = {kv for _, kv in used}
    assert walks and all(walks)  # every static verify walked and committed in its graph
    if target.attention == "triton":  # it reads the context's rows whatever the span: one span
        assert spans == {cache.rows} and len(cache.graphs) == len(cache.stages)
        return
    assert set(kv_buckets(cache.rows)) <= spans and len(spans) >= 3, spans
    assert len(cache.graphs) == sum(1 for q in cache.stages for kv in kv_buckets(cache.rows) if kv >= q)


def test_graphs_a_dropped_session_gives_its_slot_back(tiny):
    import gc

    ref, fast = tiny
    slots = fast.impl.slots
    gen = GenParams(max_new_tokens=20, ignore_eos=True)
    sessions = [fast.start([5, 6, 7], gen, SpecParams("ddtree", 16)) for _ in range(slots)]
    for s in sessions:
        s.step()
        s.step()
    assert not fast.impl._free
    del sessions, s
    gc.collect()
    assert len(fast.impl._free) == slots
    _compare(ref, fast, _tiny_prompts()[:2], GenParams(max_new_tokens=12, ignore_eos=True), SPECS[:3])


def test_graphs_demo_pair_fp32_equal_ar_and_transformers():
    _need_demo()
    auto = Engine.load(DEMO_TARGET, DEMO_DRAFTER, device="cuda", max_budget=256)
    assert auto.backend == "fast" and "CUDA" in auto.backend_reason and auto.dtype == torch.float32
    ref = Engine.load(DEMO_TARGET, DEMO_DRAFTER, device="cuda", backend="transformers", max_budget=256)
    fast = _warm(auto)
    prompts = _demo_prompts(ref.tokenizer, 3)
    assert _compare(ref, fast, prompts, GenParams(max_new_tokens=64, ignore_eos=True)) > 20


# ---- bf16: every first divergence from AR is a near-tie ---------------------------------------
def _gap(logits: torch.Tensor, a: int, b: int) -> dict:
    top = logits.topk(2).values
    return {"a_minus_b": float(logits[a] - logits[b]), "top2": float(top[0] - top[1]),
            "tol": 4 * BF16_ULP * max(1.0, abs(float(logits[a])), abs(float(logits[b])))}


def _ar_step_logits(engine: Engine, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """The logits each AR step chose tokens[i] from, computed as Session does (a prefill, then one
    token a forward), on the kind of cache a session gets (a graph slot on the fast backend)."""
    target = engine.target
    cache, draft_cache = engine.impl.new_caches(False)
    try:
        with torch.inference_mode():
            ids = torch.tensor(prompt, device=target.device)
            out = target.forward(ids, torch.arange(len(prompt), device=target.device), cache,
                                 features=False, last_only=True)
            rows = [out.logits[-1].float()]
            for i, token in enumerate(tokens[:-1]):
                pos = torch.tensor([len(prompt) + i], device=target.device)
                out = target.forward(torch.tensor([token], device=target.device), pos, cache, features=False)
                rows.append(out.logits[-1].float())
    finally:
        engine.impl.release(cache, draft_cache)
    return rows


def _full_recompute(engine: Engine, ids: list[int]) -> torch.Tensor:
    """The last row's logits of one forward over the whole prefix, on a fresh cache."""
    target = engine.target
    with torch.inference_mode():
        t = torch.tensor(ids, device=target.device)
        out = target.forward(t, torch.arange(len(ids), device=target.device), target.new_cache(),
                             features=False, last_only=True)
    return out.logits[-1].float()


@pytest.mark.parametrize("backend", ["transformers", "fast"])
def test_bf16_divergences_from_ar_are_near_ties(backend):
    _need_demo()
    engine = Engine.load(DEMO_TARGET, DEMO_DRAFTER, device="cuda", dtype=torch.bfloat16,
                         backend=backend, max_budget=64)
    assert engine.dtype == torch.bfloat16
    if backend == "fast":
        _warm(engine)
    gen = GenParams(max_new_tokens=96, ignore_eos=True)
    specs = [SpecParams("dflash"), SpecParams("ddtree", 16), SpecParams("ddtree", 64)]
    found, bad = [], []
    for p, prompt in enumerate(_demo_prompts(engine.tokenizer, 12)):
        ar = engine.generate(prompt, gen, AR).output_ids
        assert len(ar) == 96
        steps = None
        for spec in specs:
            got = engine.generate(prompt, gen, spec).output_ids
            assert len(got) == 96, (spec, p)
            i = next((k for k, (x, y) in enumerate(zip(ar, got)) if x != y), None)
            if i is None:
                continue
            if steps is None:
                steps = _ar_step_logits(engine, prompt, ar)
            a, b = ar[i], got[i]
            record = {"prompt": p, "spec": f"{spec.algorithm}-{spec.budget}", "pos": i, "ar": a, "spec_token": b,
                      "replayed_ar_token": int(steps[i].argmax()),
                      "ar_step": _gap(steps[i], a, b), "full": _gap(_full_recompute(engine, prompt + ar[:i]), a, b)}
            found.append(record)
            if any(abs(record[k]["a_minus_b"]) > record[k]["tol"] for k in ("ar_step", "full")):
                bad.append(record)
    assert not bad, (f"{backend}: {len(bad)} of {len(found)} first divergences are not bf16 near-ties", bad, found)
