"""The fast backend decodes exactly what the transformers reference decodes (issue 14, Correctness).

CPU, float32, the fast backend's non-graph code (eager, and the static padded path that CUDA
graphs capture). Greedy output is compared token for token, and accept lengths round for round,
against the transformers backend and against plain AR decoding; sampling is checked by running
the chi-square and seeded-sampling tests of test_decode.py on the fast backend.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ddtree.engine.reference.engine import Engine, GenParams, SpecParams, choose_backend
from ddtree.engine.reference.errors import BadParams, ModelLoadError
from ddtree.engine.reference.fast.backend import FastPath
from ddtree.engine.reference.fast.draft import default_buckets
from ddtree.engine.reference.fast.target import FastTarget

from . import test_decode as reference
from .conftest import make_drafter, make_target

ROOT = Path(__file__).resolve().parents[3]
DEMO_TARGET = ROOT / "assets" / "demo" / "target"
DEMO_DRAFTER = ROOT / "assets" / "demo" / "drafter"
PROMPTS = ROOT / "assets" / "prompts" / "code.jsonl"

# Trees of budget + 1 nodes: on both sides of the static path's power-of-two buckets.
BUDGETS = (1, 2, 3, 7, 16, 63, 64, 255, 256)
AR = SpecParams("ar")
SPECS = [AR, SpecParams("dflash")] + [SpecParams("ddtree", b) for b in BUDGETS]


class FastEngine(Engine):
    """Engine with backend="fast" by default: test_decode's tests, run on the fast backend."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("backend", "fast")
        super().__init__(*args, **kwargs)


def make_llama(seed: int = 0, *, vocab: int = 64, layers: int = 4, hidden: int = 64,
               scale: float = 4.0, max_pos: int = 512):
    """A random Llama in float32, sharpened like conftest.make_target."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_pos, tie_word_embeddings=False,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None, rope_theta=10000.0)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
        model.model.embed_tokens.weight.mul_(scale / 2)
    return model


def _prompts(n: int, seed: int, *, vocab: int = 60, longest: int = 48) -> list[list[int]]:
    """n prompts of varied lengths, 1 and `longest` tokens among them (ids below the mask token)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [1, longest] + torch.randint(2, longest, (max(0, n - 2),), generator=g).tolist()
    return [torch.randint(0, vocab, (k,), generator=g).tolist() for k in lengths[:n]]


def _engines(model, drafter, **kwargs) -> tuple[Engine, Engine]:
    return (Engine(model, drafter, backend="transformers", **kwargs),
            Engine(model, drafter, backend="fast", **kwargs))


def _first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _check_same(got, want, ar_ids: list[int], label) -> None:
    """Fast result == transformers result (tokens, rounds, reason) == AR tokens."""
    where = _first_diff(got.output_ids, ar_ids)
    assert got.output_ids == ar_ids, (label, "fast differs from AR at", where, got.output_ids, ar_ids)
    assert want.output_ids == ar_ids, (label, "transformers differs from AR", want.output_ids, ar_ids)
    assert got.accept_lengths == want.accept_lengths, (label, got.accept_lengths, want.accept_lengths)
    assert got.finish_reason == want.finish_reason, (label, got.finish_reason, want.finish_reason)


def _compare(ref: Engine, fast: Engine, prompts, gen: GenParams, specs) -> int:
    """Every spec on every prompt, both backends; returns the drafted tokens accepted (beyond roots)."""
    accepted = 0
    for prompt in prompts:
        ar = ref.generate(prompt, gen, AR)
        for spec in specs:
            want = ar if spec is AR else ref.generate(prompt, gen, spec)
            got = fast.generate(prompt, gen, spec)
            _check_same(got, want, ar.output_ids, (spec, len(prompt), gen.max_new_tokens))
            accepted += sum(t - 1 for t in got.accept_lengths)
    return accepted


# ---- 1. greedy: fast == transformers == AR ----------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_fast_equals_transformers_and_ar(arch):
    model = make_target(21) if arch == "qwen3" else make_llama(22)
    ref, fast = _engines(model, make_drafter(model, block_size=8, seed=5))
    assert isinstance(fast.impl, FastPath) and isinstance(fast.target, FastTarget)
    prompts = _prompts(8, 3 if arch == "qwen3" else 4)
    # Qwen3 over every budget; Llama over a spread of them (the slow test takes all).
    specs = SPECS if arch == "qwen3" else [AR, SpecParams("dflash")] + [SpecParams("ddtree", b) for b in (1, 7, 64, 256)]
    accepted = _compare(ref, fast, prompts, GenParams(max_new_tokens=10, ignore_eos=True), specs)
    assert accepted > 0  # some drafts were accepted, so the commit paths ran


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_fast_equals_transformers_many_prompts(arch):
    model = make_target(24, layers=3) if arch == "qwen3" else make_llama(25, layers=3)
    ref, fast = _engines(model, make_drafter(model, block_size=16, seed=6))
    assert _compare(ref, fast, _prompts(12, 7), GenParams(max_new_tokens=40, ignore_eos=True), SPECS) > 0


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_short_block_length_cuts_and_context_window(arch):
    """engine.block_size below the drafter's, max_new_tokens cutting the last round's depth, and
    sessions that run into the context window."""
    build = make_target if arch == "qwen3" else make_llama
    model = build(26, max_pos=128)
    drafter = make_drafter(model, block_size=8, seed=7)
    specs = [AR, SpecParams("dflash"), SpecParams("ddtree", 3), SpecParams("ddtree", 64)]
    ref, fast = _engines(model, drafter, block_size=4)
    assert fast.block_size == ref.block_size == 4
    for n in (1, 3, 13):
        _compare(ref, fast, _prompts(2, n, longest=20), GenParams(max_new_tokens=n, ignore_eos=True), specs)
    fast.block_size = ref.block_size = 6  # the attribute may change between requests
    _compare(ref, fast, _prompts(2, 8), GenParams(max_new_tokens=11, ignore_eos=True), specs)
    ref, fast = _engines(model, drafter, context_window=40)
    gen = GenParams(max_new_tokens=64, ignore_eos=True)
    for length in (20, 33, 38, 39):
        prompt = torch.randint(0, 60, (length,), generator=torch.Generator().manual_seed(length)).tolist()
        _compare(ref, fast, [prompt], gen, specs)
        r = fast.generate(prompt, gen, SpecParams("ddtree", 64))
        assert r.finish_reason == "length" and len(r.output_ids) == 40 - length + 1


# ---- the demo pair ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo():
    """(auto-chosen engine, fast engine, held-out prompts as ids) for the shipped demo pair."""
    if not (DEMO_TARGET / "config.json").is_file():
        pytest.skip("the demo pair is not in assets/demo")
    auto = Engine.load(DEMO_TARGET, DEMO_DRAFTER)
    fast = Engine.load(DEMO_TARGET, DEMO_DRAFTER, backend="fast")
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    held = [r["prompt"] for r in rows if r.get("split") == "heldout"]
    ids = [auto.tokenizer.encode(text) for text in held[:12]]
    return auto, fast, ids


def test_load_auto_on_cpu_takes_transformers_and_fast_when_asked(demo):
    auto, fast, _ = demo
    assert auto.backend == "transformers" and auto.impl.name == "transformers"
    assert "auto" in auto.backend_reason and "CPU" in auto.backend_reason
    assert fast.backend == "fast" and isinstance(fast.impl, FastPath) and isinstance(fast.target, FastTarget)
    assert fast.backend_reason == "asked for"
    assert not fast.graphs  # no CUDA graphs on a CPU, before or after warmup
    fast.warmup()
    assert not fast.graphs
    assert fast.dtype == auto.dtype == torch.float32


@pytest.mark.slow
def test_demo_pair_fast_equals_transformers(demo):
    auto, fast, prompts = demo
    specs = [AR, SpecParams("dflash"), SpecParams("ddtree", 16), SpecParams("ddtree", 64)]
    gen = GenParams(max_new_tokens=24, ignore_eos=True)
    accepted = _compare(auto, fast, prompts[:2], gen, specs)
    assert accepted > 10  # the trained drafter gets long paths accepted


@pytest.mark.slow
def test_demo_pair_fast_equals_transformers_all_budgets(demo):
    auto, fast, prompts = demo
    _compare(auto, fast, prompts[2:6], GenParams(max_new_tokens=48, ignore_eos=True), SPECS)
    # Stop tokens (eos) and a short block on the trained pair too.
    _compare(auto, fast, prompts[8:10], GenParams(max_new_tokens=48), SPECS[:4])
    auto.block_size = fast.block_size = 4
    try:
        _compare(auto, fast, prompts[10:12], GenParams(max_new_tokens=33, ignore_eos=True), SPECS[:6])
    finally:
        auto.block_size = fast.block_size = auto.drafter.block_size


# ---- 2. the static padded path == the eager path ----------------------------------------------
def _count_static(monkeypatch, target: FastTarget) -> list[int]:
    calls = []
    forward = target.static_forward

    def counted(ids, *args, **kwargs):
        calls.append(int(ids.shape[0]))
        return forward(ids, *args, **kwargs)

    monkeypatch.setattr(target, "static_forward", counted)
    return calls


@pytest.mark.slow
@pytest.mark.parametrize("max_budget", [1024, 16])
def test_static_padded_path_equals_eager(monkeypatch, max_budget):
    """max_budget 16: buckets end at 32, so long prompts prefill eagerly and rounds run static."""
    model = make_target(27)
    drafter = make_drafter(model, block_size=8, seed=8)
    eager = Engine(model, drafter, backend="fast", max_budget=max_budget)
    static = Engine(model, drafter, backend="fast", max_budget=max_budget)
    static.target.static = True
    calls = _count_static(monkeypatch, static.target)
    budgets = [b for b in (1, 3, 7, 16, 63, 64, 256) if b <= max_budget]
    specs = [AR, SpecParams("dflash")] + [SpecParams("ddtree", b) for b in budgets]
    gen = GenParams(max_new_tokens=12, ignore_eos=True)
    for prompt in _prompts(3, 9, longest=40):
        for spec in specs:
            want = eager.generate(prompt, gen, spec)
            got = static.generate(prompt, gen, spec)
            assert got.output_ids == want.output_ids, (spec, len(prompt))
            assert got.accept_lengths == want.accept_lengths, (spec, len(prompt))
    assert calls and max(calls) == static.target._bucket(max(budgets) + 1)
    assert set(calls) <= set(static.target.buckets)


# ---- 3. sampling: test_decode's tests on the fast backend -------------------------------------
@pytest.mark.parametrize("name", [
    "test_sampled_tokens_follow_the_target_distribution",
    "test_sampling_is_reproducible_with_a_seed",
    "test_stop_tokens_eos_and_length",
    "test_context_window_ends_generation",
    "test_session_rounds_interleave",
    "test_result_statistics",
    "test_bad_params_are_named_errors",
    "test_llama_target_and_shorter_block",
])
@pytest.mark.slow
def test_decode_tests_pass_on_the_fast_backend(name, monkeypatch):
    monkeypatch.setattr(reference, "Engine", FastEngine)
    getattr(reference, name)()


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_decode_greedy_test_passes_on_the_fast_backend(block_size, monkeypatch):
    monkeypatch.setattr(reference, "Engine", FastEngine)
    reference.test_greedy_dflash_and_ddtree_equal_ar(block_size)


def test_reused_tests_build_fast_engines(monkeypatch):
    """The reused tests really build fast engines (not the transformers default)."""
    built = []

    class Recording(FastEngine):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            built.append(self.backend)

    monkeypatch.setattr(reference, "Engine", Recording)
    reference.test_sampling_is_reproducible_with_a_seed()
    assert built == ["fast"]


@pytest.mark.slow
def test_seeded_sampling_equals_the_transformers_backend():
    """Same seed, same draws: float32 logits of the two backends agree to ~1e-6, far below what
    moves a multinomial draw, and the trees (so the rows sampled) are the same."""
    model = make_target(28)
    ref, fast = _engines(model, make_drafter(model, block_size=8, seed=9))
    for seed in range(3):
        gen = GenParams(max_new_tokens=20, temperature=0.8, top_p=0.9, seed=seed, ignore_eos=True)
        for spec in (AR, SpecParams("dflash"), SpecParams("ddtree", 16)):
            got = fast.generate([1, 2, 3, seed], gen, spec)
            want = ref.generate([1, 2, 3, seed], gen, spec)
            assert got.output_ids == want.output_ids, (seed, spec)
            assert got.output_ids == fast.generate([1, 2, 3, seed], gen, spec).output_ids


# ---- 4. backend selection ---------------------------------------------------------------------
def _save_with_tokenizer(model, directory: Path) -> Path:
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (DEMO_TARGET / name).is_file():
            shutil.copy(DEMO_TARGET / name, directory / name)
    return directory


def _sliding_mistral():
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        sliding_window=16, tie_word_embeddings=False,
                        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return MistralForCausalLM(cfg).float().eval()


def test_fast_backend_refuses_unsupported_targets_in_one_line(tmp_path):
    model = _sliding_mistral()
    target = _save_with_tokenizer(model, tmp_path / "mistral")
    with pytest.raises(BadParams) as err:
        Engine.load(target, backend="fast")
    assert "sliding" in str(err.value) and "\n" not in str(err.value)
    auto = Engine.load(target)
    assert auto.backend == "transformers" and "sliding" in auto.backend_reason
    with pytest.raises(ModelLoadError) as err:
        Engine(model, backend="fast")
    assert "sliding" in str(err.value) and "\n" not in str(err.value)
    # A hybrid (linear-attention) target is refused from its config alone, before any weight loads.
    nxt = tmp_path / "next"
    nxt.mkdir()
    (nxt / "config.json").write_text(json.dumps({
        "model_type": "qwen3_next", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"]}))
    with pytest.raises(BadParams) as err:
        Engine.load(nxt, backend="fast")
    assert "qwen3_next" in str(err.value) and "\n" not in str(err.value)


def test_unknown_backend_is_bad_params(tmp_path):
    model = make_target(0, layers=2)
    with pytest.raises(BadParams, match="unknown backend"):
        Engine(model, backend="vllm")
    with pytest.raises(BadParams, match="unknown backend"):
        Engine(model, backend="auto")  # auto is Engine.load's choice, not the constructor's
    with pytest.raises(BadParams, match="unknown backend"):
        Engine.load(_save_with_tokenizer(model, tmp_path / "qwen3"), backend="vllm")


def test_choose_backend_auto_takes_fast_on_cuda_only_where_it_runs():
    config = json.loads((DEMO_TARGET / "config.json").read_text()) if (DEMO_TARGET / "config.json").is_file() \
        else make_target(0, layers=2).config.to_dict()
    chosen, why = choose_backend("auto", config, "cuda:0")
    assert chosen == "fast" and "qwen3" in why
    assert choose_backend("auto", config, "cpu")[0] == "transformers"
    assert choose_backend("transformers", config, "cuda") == ("transformers", "asked for")
    assert choose_backend("fast", config, "cpu") == ("fast", "asked for")
    sliding = _sliding_mistral().config.to_dict()
    chosen, why = choose_backend("auto", sliding, "cuda")
    assert chosen == "transformers" and "sliding" in why


def test_fast_engine_on_a_plain_decoder_shares_the_weights():
    """Engine(hf_model, backend="fast") runs our forward over the transformers model's own tensors."""
    model = make_target(29, layers=2)
    fast = Engine(model, backend="fast")
    ours = dict(fast.model.named_parameters())
    assert ours["model.embed_tokens.weight"].data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert ours["lm_head.weight"].data_ptr() == model.lm_head.weight.data_ptr()
    gen = GenParams(max_new_tokens=10, ignore_eos=True)
    assert fast.generate([3, 4, 5], gen, AR).output_ids == Engine(model).generate([3, 4, 5], gen, AR).output_ids


# ---- 5. session slots -------------------------------------------------------------------------
def _add_slots(engine: Engine, n: int, *, static: bool) -> list[tuple]:
    """The slot pool warmup() makes on CUDA, minus the graph captures (a CPU has none): n cache
    pairs the engine hands out and takes back. static: the drafter caches take the static path."""
    impl = engine.impl
    pairs = []
    for _ in range(n):
        draft = impl.drafts.new_cache(append_buckets=default_buckets(engine.drafter.block_size) if static else None)
        pair = (impl.target.new_cache(), draft)
        impl.add_slot(*pair)
        pairs.append(pair)
    return pairs


def _live_caches_distinct(sessions) -> None:
    live = [s for s in sessions if not s.done]
    targets = [id(s._cache) for s in live]
    drafts = [id(s._draft_cache) for s in live if s._draft_cache is not None]
    assert all(s._cache is not None for s in live)
    assert len(set(targets)) == len(targets), "two live sessions share a target cache"
    assert len(set(drafts)) == len(drafts), "two live sessions share a drafter cache"


JOBS = [(SpecParams("ddtree", 32), 17), (AR, 9), (SpecParams("dflash"), 21), (SpecParams("ddtree", 4), 13),
        (SpecParams("ddtree", 128), 25), (SpecParams("dflash"), 6), (SpecParams("ddtree", 7), 19),
        (AR, 15), (SpecParams("ddtree", 63), 23)]


@pytest.mark.slow
@pytest.mark.parametrize("slots", [0, 3])
def test_interleaved_sessions_equal_serial_and_never_share_a_cache(slots):
    model = make_target(30)
    drafter = make_drafter(model, block_size=8, seed=10)
    fast = Engine(model, drafter, backend="fast")
    fast.target.static = bool(slots)  # with slots: the static path, as the graphs would run it
    pool = _add_slots(fast, slots, static=True)
    prompts = _prompts(len(JOBS), 11, longest=30)
    jobs = [(p, GenParams(max_new_tokens=m, ignore_eos=True), spec) for p, (spec, m) in zip(prompts, JOBS)]
    # Lossless output would hide a stale drafter cache: the accept lengths show it.
    serial = [Engine(model, drafter).generate(*job) for job in jobs]
    # Six start at once (beyond the slots); two close early; the rest start as others finish.
    sessions = [fast.start(*job) for job in jobs[:6]]
    waiting = list(range(6, len(jobs)))
    closed = {1: 3, 4: 2}  # session index -> rounds it runs before the client goes away
    rounds = 0
    while not all(s.done for s in sessions) or waiting:
        for i, s in enumerate(sessions):
            if not s.done:
                s.step()
            if closed.get(i) == rounds and not s.done:
                s.close()
        _live_caches_distinct(sessions)
        if waiting and sum(not s.done for s in sessions) < 5:
            sessions.append(fast.start(*jobs[waiting.pop(0)]))
            _live_caches_distinct(sessions)
        rounds += 1
    for i, (s, want) in enumerate(zip(sessions, serial)):
        rounds_run = len(s.accept_lengths)
        assert s.accept_lengths == want.accept_lengths[:rounds_run], i
        if i in closed:
            assert s.finish_reason == "abort" and s.output_ids == want.output_ids[:len(s.output_ids)]
        else:
            assert s.finish_reason == "length" and s.output_ids == want.output_ids, i
        assert s._cache is None and s.step() == []
    if slots:  # every slot went back to the pool, once
        assert len(fast.impl._free) == slots and {id(p[0]) for p in fast.impl._free} == {id(p[0]) for p in pool}


@pytest.mark.slow
def test_a_reused_slot_decodes_like_a_fresh_cache(demo, monkeypatch):
    """The demo pair on the static path through one slot, against the transformers backend. A slot that held a long sequence (stale rows past the new length) serves the next ones with
    the same drafts as a fresh cache: on the trained pair a stale drafter context shows up in the
    accept lengths (the output alone would stay lossless and hide it)."""
    auto, _, prompts = demo
    fast = Engine(auto.model, auto.drafter, backend="fast", max_budget=64, mask_token_id=auto.mask_token_id,
                  eos_token_ids=auto.eos_token_ids)
    fast.target.static = True
    calls = _count_static(monkeypatch, fast.target)
    _add_slots(fast, 1, static=True)
    gen = GenParams(max_new_tokens=24, ignore_eos=True)
    order = sorted(prompts[:4], key=len, reverse=True)  # the longest first: later ones see its stale rows
    for prompt, spec in zip(order, [SpecParams("ddtree", 64), SpecParams("dflash"), AR, SpecParams("ddtree", 63)]):
        sess = fast.start(prompt, gen, spec)
        assert fast.impl.slot_of(sess._cache) is not None  # the slot, not a new cache
        while not sess.done:
            sess.step()
        want = auto.generate(prompt, gen, spec)
        assert sess.output_ids == want.output_ids
        assert sess.accept_lengths == want.accept_lengths
    assert len(fast.impl._free) == 1
    assert 65 in calls and 129 not in calls  # 65 nodes (budget 64) and 64 nodes (budget 63) fit bucket 65


# ---- 6. step_many == serial -------------------------------------------------------------------
def test_step_many_equals_serial_stepping():
    model = make_target(32)
    drafter = make_drafter(model, block_size=8, seed=13)
    fast = Engine(model, drafter, backend="fast")
    prompts = _prompts(6, 14, longest=24)
    greedy = [(GenParams(max_new_tokens=m, ignore_eos=True), spec) for m, spec in
              [(20, SpecParams("ddtree", 32)), (9, AR), (17, SpecParams("dflash")), (12, SpecParams("ddtree", 3))]]
    sampled = [(GenParams(max_new_tokens=15, temperature=0.9, seed=s, ignore_eos=True), SpecParams("ddtree", 8))
               for s in (1, 2)]
    jobs = [(p, *j) for p, j in zip(prompts, greedy + sampled)]
    serial = [fast.generate(*job) for job in jobs]
    sessions = [fast.start(*job) for job in jobs[:4]]
    late = [fast.start(*job) for job in jobs[4:]]
    steps = 0
    while not all(s.done for s in sessions + late):
        batch = sessions + (late if steps >= 2 else [])  # two join after two rounds
        done = [s.done for s in batch]
        out = fast.step_many(batch)
        assert len(out) == len(batch)
        assert all(o == [] for o, d in zip(out, done) if d) and all(o for o, d in zip(out, done) if not d)
        steps += 1
    for s, want in zip(sessions + late, serial):
        assert s.output_ids == want.output_ids
        assert s.accept_lengths == want.accept_lengths
    with pytest.raises(BadParams):
        fast.step_many([sessions[0], sessions[0]])
    other = Engine(model, drafter, backend="fast")
    with pytest.raises(BadParams):
        fast.step_many([other.start([1, 2], GenParams(max_new_tokens=2), AR)])


def test_a_dense_decoder_on_the_transformers_backend_is_a_named_error():
    from ddtree.engine.reference.fast.backend import decoder_from_hf

    decoder = decoder_from_hf(make_target(0, layers=2))
    with pytest.raises((BadParams, ModelLoadError)):
        Engine(decoder, backend="transformers")
