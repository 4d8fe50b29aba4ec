"""Fixtures: a tiny random Qwen3 target + DFlash drafter (built once per session), a real builtin
server subprocess on it, and a recipe writer. The demo pair is not needed (nor faster) for these."""

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

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")
CONTEXT_WINDOW = 256


def build_tiny_pair(root: Path) -> tuple[Path, Path]:
    """A random 2-layer Qwen3 target (hidden 32) with a byte-level BPE tokenizer, a 1-layer drafter (block 4)."""
    import inspect
    import json as json_module

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ddtree.engine.reference.drafter import DFlashConfig, DFlashDrafter, save_drafter

    target_dir, drafter_dir = root / "target", root / "drafter"
    target_dir.mkdir(parents=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(inspect.getsource(json_module).splitlines(keepends=True), trainer=trainer)
    tok.save(str(target_dir / "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                        "single_word": False, "special": True} for t in SPECIALS}
    (target_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": added, "eos_token": SPECIALS[0],
        "pad_token": SPECIALS[0], "mask_token": SPECIALS[3], "model_max_length": CONTEXT_WINDOW}))
    vocab = tok.get_vocab_size()
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      max_position_embeddings=CONTEXT_WINDOW, eos_token_id=0, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(target_dir)
    dcfg = DFlashConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, vocab_size=vocab, num_target_layers=2, target_layer_ids=(0,),
                        mask_token_id=3, block_size=4, head_dim=16, max_position_embeddings=CONTEXT_WINDOW)
    save_drafter(DFlashDrafter(dcfg), drafter_dir)
    return target_dir, drafter_dir


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    return build_tiny_pair(tmp_path_factory.mktemp("sweep-pair"))


@pytest.fixture(scope="session")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    lines = [{"prompt": f"def f{i}(x):\n    return x + {i}\n"} for i in range(12)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


class Server:
    """The builtin server as a subprocess of the test (own group, free port, log file)."""

    def __init__(self, argv: list[str], log_path: Path, timeout_s: float = 120.0) -> None:
        self.log_path = log_path
        self.log = open(log_path, "wb")
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.log, env=env, start_new_session=True)
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        self.url = None
        while time.monotonic() < deadline and self.url is None:
            if sel.select(timeout=0.5):
                line = self.proc.stdout.readline()
                if not line:
                    break
                event = json.loads(line)  # warm-up steps (fast backend on CUDA) come first
                if event.get("event") == "listening":
                    self.url = event["url"]
        if self.url is None:
            self.stop()
            raise RuntimeError(f"server did not start; log:\n{log_path.read_text()[-2000:]}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc.stdout.close()
        self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory):
    target, drafter = tiny_pair
    argv = [sys.executable, "-m", "ddtree.engine.reference.server", "--model", str(target), "--draft", str(drafter),
            "--port", "0", "--budget", "8"]
    proc = Server(argv, tmp_path_factory.mktemp("server") / "server.log")
    yield proc
    proc.stop()


def write_recipe(path: Path, tiny_pair, prompts_file: Path, **sweep) -> Path:
    """A builtin-engine recipe on the tiny pair; `sweep` overrides [sweep] keys."""
    target, drafter = tiny_pair
    table = {"budget": [2, 6], "concurrency": [1, 2], "dataset": str(prompts_file), "num_prompts": 4,
             "max_new_tokens": 8, "warmup": 1, "baseline": ["ar"], "timeout_s": 60.0, **sweep}

    def value(v):
        return json.dumps(v)

    lines = ['name = "tiny"', "[engine]", 'kind = "builtin"', f"model = {value(str(target))}",
             f"draft_model = {value(str(drafter))}", "ready_timeout_s = 120.0", "[sweep]"]
    lines += [f"{k} = {value(v)}" for k, v in table.items()]
    path.write_text("\n".join(lines) + "\n")
    return path
