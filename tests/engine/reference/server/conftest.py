"""Fixtures: a tiny random Qwen3 target + DFlash drafter built once, and real server subprocesses."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

EOS, IM_START, IM_END, MASK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CONTEXT_WINDOW = 512


def _build_tokenizer(directory: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    import inspect
    import json as json_module

    text = inspect.getsource(json_module) + inspect.getsource(inspect)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=[EOS, IM_START, IM_END, MASK], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                        "single_word": False, "special": True} for t in (EOS, IM_START, IM_END, MASK)}
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": added, "eos_token": EOS,
        "pad_token": EOS, "mask_token": MASK, "model_max_length": CONTEXT_WINDOW,
        "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}))
    return tok.get_vocab_size()


def build_tiny_pair(root: Path, *, hidden: int = 64, layers: int = 4, intermediate: int = 128, heads: int = 4,
                    block_size: int = 4) -> tuple[Path, Path]:
    """A random Qwen3 target with a tokenizer and a random DFlash drafter (tests: hidden 64, 4 layers,
    a 1-layer drafter, block 4). bench/bench_server.py builds its random pairs with _build_tokenizer too."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ddtree.engine.reference.drafter import DFlashConfig, DFlashDrafter, save_drafter

    target_dir, drafter_dir = root / "target", root / "drafter"
    vocab = _build_tokenizer(target_dir)
    torch.manual_seed(0)
    head_dim = hidden // heads
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=head_dim,
                      max_position_embeddings=CONTEXT_WINDOW, eos_token_id=0, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # sharper logits than the default init, so outputs are not near-ties
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(target_dir)
    dcfg = DFlashConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=1,
                        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), vocab_size=vocab,
                        num_target_layers=layers, target_layer_ids=(layers // 2,), mask_token_id=3,
                        block_size=block_size, head_dim=head_dim, max_position_embeddings=CONTEXT_WINDOW)
    save_drafter(DFlashDrafter(dcfg), drafter_dir)
    return target_dir, drafter_dir


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    return build_tiny_pair(tmp_path_factory.mktemp("tiny-pair"))


class ServerProcess:
    def __init__(self, argv: list[str], log_path: Path, timeout_s: float = 120.0) -> None:
        self.log_path = log_path
        self.log = open(log_path, "wb")
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.log, env=env,
                                     start_new_session=True)
        self.warmup: list[dict] = []
        self.announcement = self._read_announcement(timeout_s)
        self.url = self.announcement["url"]
        self.port = self.announcement["port"]

    def _read_announcement(self, timeout_s: float) -> dict:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if sel.select(timeout=0.5):
                line = self.proc.stdout.readline()
                if not line:
                    break
                event = json.loads(line)  # every stdout line is JSON: warm-up steps, then this
                if event.get("event") == "listening":
                    return event
                self.warmup.append(event)
        self.stop()
        raise RuntimeError(f"server did not announce itself; log:\n{self.log_path.read_text()[-3000:]}")

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc.stdout.close()
        self.log.close()
        return self.proc.returncode


CLI = [sys.executable, "-m", "ddtree.console.cli"]


@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory):
    """One server per module, started the way a user starts it: `ddtree-console serve` (which execs
    the server module). The drafter was trained with blocks of 4; the server runs it with 3."""
    target, drafter = tiny_pair
    proc = ServerProcess([*CLI, "serve", "--model", str(target), "--draft", str(drafter), "--port", "0",
                          "--budget", "8", "--block-size", "3", "--max-running-requests", "4",
                          "--max-queued-requests", "4"], tmp_path_factory.mktemp("server") / "server.log")
    yield proc
    assert proc.stop() == 0, proc.log_path.read_text()[-3000:]
