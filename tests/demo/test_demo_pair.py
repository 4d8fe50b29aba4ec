"""The shipped demo pair: loads through the engine's loaders, fits the size cap, and drafts well."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from ddtree.engine.demo import demo_paths  # noqa: E402
from ddtree.engine.reference.demo_data import split_of  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PROMPTS = REPO / "assets" / "prompts" / "code.jsonl"


@pytest.fixture(scope="module")
def engine():
    from ddtree.engine.reference.engine import Engine

    target, drafter = demo_paths()
    torch.set_num_threads(2)
    return Engine.load(target, drafter, device="cpu")


def test_pair_is_under_the_size_cap():
    total = sum(f.stat().st_size for d in demo_paths() for f in d.iterdir() if f.is_file())
    assert total <= 25 * 1024 * 1024


@pytest.mark.slow
def test_drafter_checkpoint_layout_and_weights():
    from ddtree.engine.reference.drafter import load_drafter

    target, drafter_dir = demo_paths()
    cfg = json.loads((drafter_dir / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["block_size"] == cfg["dflash_config"]["block_size"] == 16
    tcfg = json.loads((target / "config.json").read_text())
    assert cfg["num_target_layers"] == tcfg["num_hidden_layers"]
    assert cfg["dflash_config"]["mask_token"] == "<|mask|>"
    # load_drafter checks every weight's name and shape against the config.
    drafter = load_drafter(drafter_dir)
    assert drafter.mask_token_id == cfg["dflash_config"]["mask_token_id"]
    assert list(drafter.target_layer_ids) == cfg["dflash_config"]["target_layer_ids"]


@pytest.mark.slow
def test_tokenizer_round_trips_and_knows_its_special_tokens(engine):
    tok = engine.tokenizer
    text = 'def f(x):\n    """Return x, twice."""\n\treturn [x, x]  # é, 日本\n'
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert tok.convert_tokens_to_ids("<|mask|>") == engine.drafter.mask_token_id
    assert tok.eos_token == "<|endoftext|>"
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.convert_tokens_to_ids("<|im_end|>") in engine.eos_token_ids


def test_prompt_set_is_held_out():
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    assert len(rows) >= 300
    assert all(r["split"] == "heldout" and split_of(r["source"]) == "heldout" for r in rows)
    assert len({r["source"] for r in rows}) >= 40


@pytest.mark.slow
def test_dflash_acceptance_on_held_out_prompts_beats_random_weights(engine):
    from ddtree.engine.reference.engine import GenParams, SpecParams

    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()][:4]
    gen = GenParams(max_new_tokens=48)
    taus = []
    for row in rows:
        ids = engine.tokenizer.encode(row["prompt"], add_special_tokens=False)
        ar = engine.generate(ids, gen, SpecParams(algorithm="ar"))
        dflash = engine.generate(ids, gen, SpecParams(algorithm="dflash"))
        assert dflash.output_ids == ar.output_ids  # lossless at temperature 0
        taus.extend(dflash.accept_lengths)
    # An untrained drafter accepts almost nothing (tau ~1.0); the shipped one measured 1.74 on these
    # four prompts (2.63 over the benchmark's twelve).
    assert sum(taus) / len(taus) >= 1.4


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["transformers", "fast"])
def test_decoding_accepts_what_the_trained_drafter_predicts_under_teacher_forcing(engine, backend):
    """The drafter runs as it was trained: each DFlash round accepts exactly the run that
    training's teacher-forced forward (train_demo.drafter_forward, every anchor of the finished
    sequence at once) predicts at that round's anchor. A drafter fed the wrong context (an
    off-by-one feature row, a stale cache) still decodes losslessly, since the target checks every
    draft, but accepts less; this catches it. The last round may accept less than the forward
    predicts: the engine drafts no further than the tokens still wanted."""
    from ddtree.engine.reference.engine import Engine, GenParams, SpecParams
    from ddtree.engine.reference.train_demo import accept_lengths, drafter_forward

    decoder = engine if backend == "transformers" else Engine.load(*demo_paths(), device="cpu", backend=backend)
    block = engine.block_size
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()][:3]
    for row in rows:
        ids = engine.tokenizer.encode(row["prompt"], add_special_tokens=False)
        run = decoder.generate(ids, GenParams(max_new_tokens=48), SpecParams(algorithm="dflash"))
        seq = torch.tensor([ids + run.output_ids])
        anchors = torch.arange(len(ids) - 1, seq.shape[1] - 1)[None]  # the bonus token of each block
        logits = drafter_forward(engine.drafter, engine.target.model, seq, anchors, engine.drafter.mask_token_id,
                                 block, torch.device("cpu"), torch.float32)
        padded = torch.cat([seq, torch.full((1, block), -1)], dim=1)
        labels = padded[0, anchors[0, :, None] + torch.arange(block)][None]
        predicted = accept_lengths(logits, labels)[0].tolist()
        # The prefill commits the first token; each round then anchors where the last one ended.
        rounds, at = [], 1
        while at < len(predicted):
            rounds.append(predicted[at])
            at += predicted[at]
        assert run.accept_lengths[:-1] == rounds[:-1], row["id"]
        assert len(run.accept_lengths) == len(rounds) and run.accept_lengths[-1] <= rounds[-1]
