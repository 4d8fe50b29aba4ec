from __future__ import annotations

import os

import pytest

from .hub_server import Hub, RepoData

GOOD_TOKEN = "hf_AllowedTestToken0123456789"
BAD_TOKEN = "hf_WrongTestToken9876543210xyz"


def _blob(seed: int, size: int) -> bytes:
    return (bytes([seed % 251]) * 97 + bytes(range(256)))[:size] * (size // 353 + 1)


def tiny_repo() -> RepoData:
    return RepoData(files={
        "config.json": b'{"model_type": "qwen3", "hidden_size": 64}',
        "README.md": b"# tiny\n",
        "model-00001-of-00002.safetensors": _blob(1, 300_000)[:300_000],
        "model-00002-of-00002.safetensors": _blob(2, 200_000)[:200_000],
        "sub/extra.bin": _blob(3, 50_000)[:50_000],
    }, refs={"v1": ""})


def many_repo(n: int = 16, size: int = 96_000) -> RepoData:
    return RepoData(files={f"shard-{i:02d}.bin": _blob(i, size)[:size] for i in range(n)})


@pytest.fixture
def hub(monkeypatch):
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "HF_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    tiny = tiny_repo()
    tiny.refs["v1"] = tiny.sha
    repos = {
        "acme/tiny": tiny,
        "acme/many": many_repo(),
        "acme/gated": RepoData(files={"config.json": b"{}", "weights.bin": _blob(9, 4000)[:4000]}, gated=True,
                               allowed_tokens=(GOOD_TOKEN,)),
    }
    with Hub(repos, page_size=3) as h:
        yield h


@pytest.fixture
def no_token_file(tmp_path, monkeypatch):
    """Point huggingface_hub's token file at an empty place for this test."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "no-tokens"), raising=False)
    os.environ.pop("HF_TOKEN", None)
