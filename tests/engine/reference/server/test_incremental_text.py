"""IncrementalText: the streamed text is always a prefix of the whole decode, and ends equal to it."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from ddtree.engine.reference.api import IncrementalText

tokenizers = pytest.importorskip("tokenizers")

TEXT = ("def add(a, b):\n    return a + b  # sum\n\nprint('héllo wörld', \"naïve café\")\n"
        "日本語のテキスト、そして絵文字 🚀🎉 and  double  spaces\tand tabs.\n") * 3


def demo_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[4] / "assets" / "demo" / "target")


def metaspace_tokenizer():
    """A SentencePiece-style tokenizer (Metaspace, byte fallback), where decoding a token alone
    loses its leading space."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", *bytes_], show_progress=False)
    tok.train_from_iterator([TEXT.replace("🚀", "").replace("日本語", "")], trainer=trainer)
    return tok


@pytest.mark.parametrize("which", ["demo byte-level BPE", "sentencepiece-style"])
def test_streamed_text_is_a_prefix_and_ends_exact(which):
    if which.startswith("demo"):
        tok = demo_tokenizer()
        encode, decode = (lambda t: tok.encode(t, add_special_tokens=False)), (lambda ids: tok.decode(ids))
    else:
        tok = metaspace_tokenizer()
        encode, decode = (lambda t: tok.encode(t).ids), (lambda ids: tok.decode(ids))
    ids = encode(TEXT)
    assert decode(ids) == TEXT or which.startswith("sentencepiece")  # the normalizer is lossy at the start
    rng = random.Random(0)
    for _ in range(5):
        inc, n, seen = IncrementalText(decode), 0, ""
        while n < len(ids):
            n = min(len(ids), n + rng.choice([1, 1, 1, 2, 3, 7]))  # rounds commit 1..k tokens
            got = inc.extend(ids[:n])
            whole = decode(ids[:n])
            assert whole.startswith(got), (n, got[-20:], whole[-20:])
            assert got.startswith(seen)  # never retracted
            seen = got
        assert seen == decode(ids)


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("clean_up", [False, True])
def test_the_stream_decoder_decodes_as_the_tokenizer_does(skip, clean_up):
    """Random id runs over the whole vocabulary, special tokens and half characters included:
    the backend-only decoder (clean_up off) and the fallback (clean_up on) both equal decode."""
    from ddtree.engine.reference.api import stream_decoder

    tok = demo_tokenizer()
    tok.clean_up_tokenization_spaces = clean_up
    decode = stream_decoder(tok, skip)
    assert ("backend" in decode.__code__.co_freevars) is not clean_up  # which way it decodes
    rng = random.Random(1)
    vocab = len(tok)
    ids = tok.encode(TEXT, add_special_tokens=False)
    for _ in range(300):
        if rng.random() < 0.5:
            run = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        else:
            start = rng.randrange(len(ids))
            run = ids[start:start + rng.randint(1, 12)] + [rng.choice(tok.all_special_ids)]
        assert decode(run) == tok.decode(run, skip_special_tokens=skip), run
