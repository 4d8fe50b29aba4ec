"""Data for the demo pair: a corpus from Python's own standard library, its tokenizer, prompts.

Every machine with Python has the corpus offline. Files are taken in sorted order and split into
train / held-out by a stable hash of their path relative to the stdlib folder, so the split does
not depend on the machine or on the order a directory listing returns. `prepare` writes one
folder (tokenizer + token ids as a torch file + a manifest) that training reads; the GPU machine
may run another Python version, so it never reads its own stdlib: it reads that folder.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import platform
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path

# Folders whose files are data tables, generated docs or third-party code, not idiomatic source.
SKIP_DIRS = {"site-packages", "dist-packages", "encodings", "pydoc_data", "__pycache__", "lib2to3",
             "idlelib", "turtledemo", "ensurepip"}
MAX_FILE_BYTES = 400_000
MAX_LINE_CHARS = 400

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK = "<|mask|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END, MASK]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class SourceFile:
    path: str      # relative to the stdlib folder, with '/' separators
    split: str     # "train" | "heldout"
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relpath: str, heldout_percent: int = 5) -> str:
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    return "heldout" if int.from_bytes(digest[:8], "big") % 100 < heldout_percent else "train"


def _usable(text: str) -> bool:
    # Long lines mean embedded data (tables, base64 blobs), which only teaches the model noise.
    return all(len(line) <= MAX_LINE_CHARS for line in text.splitlines())


def collect_sources(root: Path | None = None, heldout_percent: int = 5) -> list[SourceFile]:
    root = Path(root) if root is not None else stdlib_root()
    out: list[SourceFile] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            full = Path(dirpath) / name
            if full.stat().st_size > MAX_FILE_BYTES:
                continue
            try:
                text = full.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if not text.strip() or not _usable(text):
                continue
            rel = full.relative_to(root).as_posix()
            out.append(SourceFile(rel, split_of(rel, heldout_percent), text))
    out.sort(key=lambda s: s.path)
    return out


def chat_wrap(text: str, index: int) -> str | None:
    """A few training documents in the chat format, so chat requests get code back, not noise."""
    lines = text.splitlines(keepends=True)
    if len(lines) < 12:
        return None
    cut = 4 + index % 8
    head, rest = "".join(lines[:cut]), "".join(lines[cut:cut + 60])
    return (f"{IM_START}user\nContinue this Python code:\n{head}{IM_END}\n"
            f"{IM_START}assistant\n{rest}{IM_END}\n")


def training_documents(sources: list[SourceFile], chat_every: int = 20) -> list[str]:
    docs: list[str] = []
    for i, src in enumerate(s for s in sources if s.split == "train"):
        docs.append(src.text)
        if chat_every and i % chat_every == 0:
            wrapped = chat_wrap(src.text, i)
            if wrapped:
                docs.append(wrapped)
    return docs


def train_tokenizer(docs: list[str], vocab_size: int = 4096):
    """Byte-level BPE; ids 0..3 are the special tokens, in SPECIAL_TOKENS order."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


def save_tokenizer(tok, directory: Path) -> None:
    """tokenizer.json + tokenizer_config.json (with the chat template) for AutoTokenizer."""
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False,
                                  "rstrip": False, "single_word": False, "special": True}
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "mask_token": MASK,
        "additional_special_tokens": [IM_START, IM_END],
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"eos_token": EOS, "pad_token": EOS, "mask_token": MASK,
               "additional_special_tokens": [IM_START, IM_END]}
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def encode_stream(tok, docs: list[str]) -> tuple[list[int], list[int]]:
    """Token ids of the documents joined by EOS, and each document's start offset."""
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    starts: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        starts.append(len(ids))
        ids.extend(enc.ids)
        ids.append(eos)
    return ids, starts


def function_prompts(src: SourceFile, per_file: int = 16) -> list[dict]:
    """A function's signature and docstring, or else its first statement (dedented): the model
    writes the rest of the body."""
    try:
        tree = ast.parse(src.text)
    except SyntaxError:
        return []
    lines = src.text.splitlines(keepends=True)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node, clean=False)
        if len(node.body) < (2 if doc else 3) or (doc and len(doc) < 20):
            continue
        first = node.body[0]
        text = textwrap.dedent("".join(lines[node.lineno - 1:first.end_lineno]))
        if len(text) > 900:
            continue
        found.append((node.lineno, node.name, text))
    found.sort()
    step = max(1, len(found) // per_file)
    return [{"source": src.path, "line": line, "function": name, "prompt": text}
            for line, name, text in found[::step][:per_file]]


def file_prompts(src: SourceFile, n_lines: int = 12) -> dict | None:
    """A file's first lines (imports, module docstring): the model continues the module."""
    lines = src.text.splitlines(keepends=True)
    if len(lines) < n_lines * 2:
        return None
    return {"source": src.path, "line": 1, "function": None, "prompt": "".join(lines[:n_lines])}


def build_prompts(sources: list[SourceFile], limit: int | None = 400, split: str = "heldout") -> list[dict]:
    held = [s for s in sources if s.split == split]
    per_file = [function_prompts(src) for src in held]
    # Round-robin over files, so a few big test modules cannot fill the whole set.
    fn_rows = [rows[k] for k in range(max(map(len, per_file), default=0)) for rows in per_file if k < len(rows)]
    file_rows = [r for r in (file_prompts(s) for s in held) if r]
    # Mostly functions (the benchmark's domain); some file openings for variety.
    if limit is None:
        rows = fn_rows + file_rows
    else:
        n_files = min(len(file_rows), limit // 8)
        rows = fn_rows[: limit - n_files] + file_rows[:n_files]
    py = platform.python_version()
    return [{"id": i, "split": split, "python": py, "kind": "function" if r["function"] else "file", **r}
            for i, r in enumerate(rows)]


def prepare(out_dir: Path, *, vocab_size: int = 4096, heldout_percent: int = 5,
            root: Path | None = None, max_files: int | None = None, prompts_path: Path | None = None,
            log=print) -> dict:
    """Corpus -> tokenizer + token ids (data.pt) + manifest.json in out_dir; optional prompt set."""
    import torch

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sources = collect_sources(root, heldout_percent)
    if max_files is not None:
        sources = sources[:max_files]
    train_docs = training_documents(sources)
    held_docs = [s.text for s in sources if s.split == "heldout"]
    log(f"python {platform.python_version()} stdlib {root or stdlib_root()}: {len(sources)} files, "
        f"train {len(train_docs)} docs {sum(map(len, train_docs)) / 1e6:.1f} MB chars, "
        f"heldout {len(held_docs)} files {sum(map(len, held_docs)) / 1e6:.1f} MB chars")
    tok = train_tokenizer(train_docs, vocab_size)
    save_tokenizer(tok, out_dir / "tokenizer")
    train_ids, train_starts = encode_stream(tok, train_docs)
    held_ids, held_starts = encode_stream(tok, held_docs)
    chars = sum(map(len, train_docs))
    log(f"tokenizer: vocab {tok.get_vocab_size()}, train {len(train_ids)} tokens "
        f"({chars / max(1, len(train_ids)):.2f} chars/token), heldout {len(held_ids)} tokens")
    # Prompt-shaped prefixes (a function's head, a file's opening) for the drafter's data: the
    # train split's for training, the shipped prompt set's for monitoring.
    prompt_sets = {}
    for split, limit in (("train", None), ("heldout", 400)):
        texts = [r["prompt"] for r in build_prompts(sources, limit=limit, split=split)]
        encs = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
        prompt_sets[f"{split}_prompts"] = torch.tensor([t for e in encs for t in e], dtype=torch.int16)
        prompt_sets[f"{split}_prompt_lens"] = torch.tensor([len(e) for e in encs], dtype=torch.int64)
        log(f"{split} prompts: {len(encs)} ({sum(map(len, encs))} tokens)")
    torch.save({
        **prompt_sets,
        "train": torch.tensor(train_ids, dtype=torch.int16),
        "train_starts": torch.tensor(train_starts, dtype=torch.int64),
        "heldout": torch.tensor(held_ids, dtype=torch.int16),
        "heldout_starts": torch.tensor(held_starts, dtype=torch.int64),
    }, out_dir / "data.pt")
    manifest = {
        "python": platform.python_version(),
        "stdlib": str(root or stdlib_root()),
        "heldout_percent": heldout_percent,
        "files": {s.path: s.split for s in sources},
        "vocab_size": tok.get_vocab_size(),
        "train_tokens": len(train_ids),
        "heldout_tokens": len(held_ids),
        "special_tokens": {t: tok.token_to_id(t) for t in SPECIAL_TOKENS},
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    if prompts_path is not None:
        rows = build_prompts(sources)
        prompts_path.parent.mkdir(parents=True, exist_ok=True)
        with open(prompts_path, "w", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")
        log(f"prompts: {len(rows)} held-out rows -> {prompts_path}")
    return manifest
