"""Train the demo pair: a small Qwen3 target on the stdlib corpus, then its DFlash drafter.

    python -m ddtree.engine.reference.train_demo prepare --data .demo_data \
        --prompts assets/prompts/code.jsonl
    python -m ddtree.engine.reference.train_demo train --data .demo_data --out OUT --device cuda

`prepare` runs where the corpus is (any machine with Python); `train` reads only that folder, so a
GPU machine with another Python trains on exactly the prepared tokens. The drafter learns the
block objective of ALGORITHMS.md on continuations the frozen target itself generates greedily:
for an anchor a, the block is [token a, MASK x (B-1)] at positions a..a+B-1; it sees the target's
features of positions < a and its own block; positions 1..B-1 are trained to predict the target's
tokens there, later positions weighted less. Many anchors share one pass through an additive mask.
Deterministic given --seed on CPU (CUDA kernels may differ in the last bits between runs).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ddtree.engine.reference.drafter import DFlashConfig, DFlashDrafter, context_features, save_drafter
from ddtree.engine.reference.target import cache_kwarg


@dataclass(frozen=True)
class TargetRecipe:
    hidden_size: int = 256
    num_hidden_layers: int = 8
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    seq_len: int = 512
    batch_size: int = 128
    steps: int = 3000
    lr: float = 2e-3
    warmup: int = 150
    weight_decay: float = 0.1
    eval_every: int = 250


@dataclass(frozen=True)
class GenRecipe:
    num_train: int = 8192
    num_heldout: int = 256
    prefix_lens: tuple[int, ...] = (16, 48, 96, 160)
    gen_len: int = 256
    batch_size: int = 512
    prompt_share: float = 0.5     # share of prefixes that are prompt-shaped (a function's head, a file's opening)
    max_prompt_len: int = 160


@dataclass(frozen=True)
class DraftRecipe:
    num_layers: int = 2
    target_layer_ids: tuple[int, ...] | None = None
    block_size: int = 16
    anchors: int = 32
    batch_size: int = 64
    steps: int = 3000
    lr: float = 1e-3
    warmup: int = 100
    gamma: float = 7.0
    eval_every: int = 500


class Log:
    def __init__(self, path: Path | None) -> None:
        self.fh = open(path, "a", encoding="utf-8") if path else None
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        line = f"[{time.perf_counter() - self.t0:7.1f}s] {msg}"
        print(line, flush=True)
        if self.fh:
            self.fh.write(line + "\n")
            self.fh.flush()


class StepPlan:
    """The number of steps: the recipe's, or fewer to fit a time budget.

    The count is fixed after a short probe, while the schedule is still in warm-up (which does not
    depend on the total), so a budgeted run equals one started with that count: the log prints it.
    """

    PROBE = (5, 25)

    def __init__(self, steps: int, minutes: float | None, warmup: int, log: Log, what: str) -> None:
        if minutes is not None and warmup <= self.PROBE[1]:
            raise ValueError("warm-up must outlast the probe")
        self.total, self.minutes, self.log, self.what = steps, minutes, log, what
        self.t_probe = 0.0

    def tick(self, step: int) -> None:
        if self.minutes is None:
            return
        if step == self.PROBE[0]:
            self.t_probe = time.perf_counter()
        elif step == self.PROBE[1]:
            per_step = (time.perf_counter() - self.t_probe) / (self.PROBE[1] - self.PROBE[0])
            fit = int(self.minutes * 60 * 0.9 / per_step)
            if fit < self.total:
                self.total = max(self.PROBE[1] + 1, fit)
            self.log(f"{self.what}: {per_step * 1000:.1f} ms/step; {self.total} steps "
                     f"(reproduce with that step count)")

    def over(self, elapsed: float) -> bool:
        return self.minutes is not None and elapsed > self.minutes * 60 * 1.1


def lr_at(step: int, total: int, warmup: int, peak: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def autocast(device: torch.device):
    # bf16 autocast only on CUDA: on CPU it is slower than float32 and changes nothing we need.
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


# ---------------------------------------------------------------- target


def build_target(r: TargetRecipe, vocab_size: int, special: dict[str, int]):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=vocab_size, hidden_size=r.hidden_size, intermediate_size=r.intermediate_size,
        num_hidden_layers=r.num_hidden_layers, num_attention_heads=r.num_attention_heads,
        num_key_value_heads=r.num_key_value_heads, head_dim=r.head_dim,
        max_position_embeddings=4096, tie_word_embeddings=True, rms_norm_eps=1e-6,
        bos_token_id=None, eos_token_id=special["<|endoftext|>"], pad_token_id=special["<|endoftext|>"],
    )
    cfg._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(cfg)


def sample_windows(stream: torch.Tensor, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - length - 1, (n,), generator=gen)
    idx = starts[:, None] + torch.arange(length + 1)
    return stream[idx].long()


@torch.no_grad()
def eval_target(model, windows: torch.Tensor, device, batch: int) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i:i + batch].to(device)
        with autocast(device):
            logits = model(input_ids=w[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum")
        total += loss.item()
        count += w[:, 1:].numel()
    model.train()
    return total / count


def train_target(r: TargetRecipe, data: dict, special: dict, vocab: int, device, seed: int, log: Log,
                 minutes: float | None):
    torch.manual_seed(seed)
    model = build_target(r, vocab, special).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    train = data["train"].long()
    held_windows = sample_windows(data["heldout"].long(), 64, r.seq_len, torch.Generator().manual_seed(seed + 1))
    train_windows = sample_windows(train, 64, r.seq_len, torch.Generator().manual_seed(seed + 2))
    tokens_per_step = r.batch_size * r.seq_len
    log(f"target: {n_params / 1e6:.2f}M params, {r.steps} steps x {tokens_per_step} tokens = "
        f"{r.steps * tokens_per_step / 1e6:.0f}M tokens ({r.steps * tokens_per_step / train.numel():.1f} epochs "
        f"of {train.numel() / 1e6:.2f}M)")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": r.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=r.lr, betas=(0.9, 0.95),
                            fused=device.type == "cuda")
    gen = torch.Generator().manual_seed(seed)
    model.train()
    t0 = time.perf_counter()
    curve = []
    plan = StepPlan(r.steps, minutes, r.warmup, log, "target")
    step = 0
    while step < plan.total:
        plan.tick(step)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, plan.total, r.warmup, r.lr)
        w = sample_windows(train, r.batch_size, r.seq_len, gen).to(device, non_blocking=True)
        with autocast(device):
            logits = model(input_ids=w[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), w[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        last = step == plan.total - 1
        elapsed = time.perf_counter() - t0
        over = plan.over(elapsed)
        if step % r.eval_every == 0 or last or over:
            held = eval_target(model, held_windows, device, r.batch_size)
            tr = eval_target(model, train_windows, device, r.batch_size)
            curve.append({"step": step, "loss": loss.item(), "train_eval": tr, "heldout": held})
            log(f"target step {step:5d} loss {loss.item():.3f} train-eval {tr:.3f} heldout {held:.3f} "
                f"lr {opt.param_groups[0]['lr']:.2e} {tokens_per_step * (step + 1) / elapsed / 1e6:.2f}M tok/s")
        if over and not last:
            log(f"target: stopped at step {step}, past its time budget (not the schedule's end)")
            break
        step += 1
    model.eval()
    return model, curve


def round_to_bf16(model) -> None:
    # The shipped weights are bf16: generate and extract features from exactly those values.
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())


def save_target(model, out: Path, tokenizer_dir: Path | None, special: dict) -> None:
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        eos_token_id=[special["<|endoftext|>"], special["<|im_end|>"]],
        pad_token_id=special["<|endoftext|>"], do_sample=False)
    model.save_pretrained(str(out))
    model.float()
    if tokenizer_dir is not None:
        for f in sorted(tokenizer_dir.iterdir()):
            shutil.copy(f, out / f.name)


# ---------------------------------------------------------------- continuations


@torch.no_grad()
def greedy_continue(model, prefixes: torch.Tensor, gen_len: int) -> torch.Tensor:
    """[n, P] -> [n, gen_len] greedy tokens, with a KV cache, in the model's dtype (float32)."""
    from transformers import DynamicCache

    kw = cache_kwarg(model)
    try:
        cache = DynamicCache(config=model.config)
    except TypeError:
        cache = DynamicCache()
    out = model(input_ids=prefixes, use_cache=True, **{kw: cache})
    nxt = out.logits[:, -1].argmax(-1)
    toks = [nxt]
    pos = prefixes.shape[1]
    for _ in range(gen_len - 1):
        position_ids = torch.full((prefixes.shape[0], 1), pos, device=prefixes.device)
        out = model(input_ids=nxt[:, None], position_ids=position_ids, use_cache=True, **{kw: cache})
        nxt = out.logits[:, -1].argmax(-1)
        toks.append(nxt)
        pos += 1
    return torch.stack(toks, dim=1)


def make_prefixes(stream: torch.Tensor, starts: torch.Tensor, n: int, length: int,
                  gen: torch.Generator) -> torch.Tensor:
    # A quarter start at a file's beginning (as the prompts do), the rest anywhere in a file.
    pos = torch.randint(0, stream.numel() - length - 1, (n,), generator=gen)
    doc = starts[torch.randint(0, starts.numel(), (n,), generator=gen)]
    pick = torch.rand(n, generator=gen) < 0.25
    pos = torch.where(pick & (doc < stream.numel() - length - 1), doc, pos)
    return stream[pos[:, None] + torch.arange(length)].long()


@dataclass
class SeqSet:
    tokens: torch.Tensor      # [n, L] int64, right-padded with EOS
    gen_start: torch.Tensor   # [n] first generated position
    valid_end: torch.Tensor   # [n] one past the last position whose token is a target choice to learn


def split_prompts(flat: torch.Tensor, lens: torch.Tensor, max_len: int) -> list[torch.Tensor]:
    out, pos = [], 0
    for n in lens.tolist():
        if 4 <= n <= max_len:
            out.append(flat[pos:pos + n].long())
        pos += n
    return out


def generate_set(model, stream, starts, prompts: list[torch.Tensor], n: int, g: GenRecipe, device, seed: int,
                 eos: int, log: Log, name: str) -> SeqSet:
    """n greedy continuations: of prompt-shaped prefixes (share g.prompt_share) and of windows."""
    gen = torch.Generator().manual_seed(seed)
    max_len = max(max(g.prefix_lens), g.max_prompt_len) + g.gen_len
    tokens = torch.full((n, max_len), eos, dtype=torch.long)
    gen_start = torch.zeros(n, dtype=torch.long)
    valid_end = torch.zeros(n, dtype=torch.long)
    t0 = time.perf_counter()
    n_prompt = int(round(n * g.prompt_share)) if prompts else 0
    batches: list[tuple[torch.Tensor, torch.Tensor]] = []  # (left-padded prefixes, true lengths)
    if n_prompt:
        picks = torch.cat([torch.randperm(len(prompts), generator=gen)
                           for _ in range(n_prompt // len(prompts) + 1)])[:n_prompt]
        chosen = sorted((prompts[i] for i in picks.tolist()), key=len)
        for i in range(0, n_prompt, g.batch_size):
            group = chosen[i:i + g.batch_size]
            width = max(map(len, group))
            # Left padding with visible EOS tokens (a document boundary the model knows) keeps
            # every attention row non-empty; sorting by length keeps the padding short.
            pre = torch.full((len(group), width), eos, dtype=torch.long)
            for j, p in enumerate(group):
                pre[j, width - len(p):] = p
            batches.append((pre, torch.tensor([len(p) for p in group])))
    done, i = n_prompt, 0
    while done < n:
        p_len = g.prefix_lens[i % len(g.prefix_lens)]
        b = min(g.batch_size, n - done)
        batches.append((make_prefixes(stream, starts, b, p_len, gen), torch.full((b,), p_len)))
        done += b
        i += 1
    row = 0
    for pre, lens in batches:
        cont = greedy_continue(model, pre.to(device), g.gen_len).cpu()
        b, width = pre.shape
        is_eos = cont == eos
        # Learn up to and including the first EOS the target emits (decoding stops there).
        first = torch.where(is_eos.any(1), is_eos.float().argmax(1), torch.full((b,), g.gen_len))
        for j in range(b):
            p = int(lens[j])
            seq = torch.cat((pre[j, width - p:], cont[j]))
            tokens[row, :seq.numel()] = seq
            gen_start[row] = p
            valid_end[row] = p + min(int(first[j]) + 1, g.gen_len)
            row += 1
    gen_tokens = int((valid_end - gen_start).sum())
    log(f"continuations ({name}): {n} sequences ({n_prompt} from prompts), {gen_tokens} generated tokens "
        f"to learn, {time.perf_counter() - t0:.1f}s")
    return SeqSet(tokens, gen_start, valid_end)


# ---------------------------------------------------------------- drafter


def pick_anchors(s: SeqSet, idx: torch.Tensor, n: int, block: int, gen: torch.Generator,
                 full_blocks: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence n anchors a (bonus at a, a >= gen_start - 1); [b, n] and a validity mask."""
    L = s.tokens.shape[1]
    pos = torch.arange(L)
    lo = (s.gen_start[idx] - 1)[:, None]
    end = s.valid_end[idx][:, None]
    hi = end - block if full_blocks else end - 2
    ok = (pos[None] >= lo) & (pos[None] <= hi) & (pos[None] <= L - block)
    score = torch.rand(idx.numel(), L, generator=gen).masked_fill(~ok, -1.0)
    top, anchors = score.topk(n, dim=1)
    return anchors, top >= 0


def block_batch(s: SeqSet, idx: torch.Tensor, anchors: torch.Tensor, block: int):
    """Labels [b, n, B] (the sequence's tokens at a..a+B-1) and their weights (0 past valid_end)."""
    offs = anchors[:, :, None] + torch.arange(block)
    labels = torch.gather(s.tokens[idx][:, None, :].expand(-1, anchors.shape[1], -1), 2, offs)
    live = offs < s.valid_end[idx][:, None, None]
    return labels, live


def block_mask(anchors: torch.Tensor, ctx_len: int, block: int, dtype) -> torch.Tensor:
    """Additive [b, 1, n*B, ctx + n*B]: block j sees context positions < a_j and its own block."""
    b, n = anchors.shape
    q = n * block
    owner = torch.arange(q, device=anchors.device) // block
    ctx_ok = torch.arange(ctx_len, device=anchors.device)[None, None, :] < anchors.repeat_interleave(block, 1)[:, :, None]
    blk_ok = (owner[:, None] == owner[None, :]).expand(b, q, q)
    allowed = torch.cat((ctx_ok, blk_ok), dim=2)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=anchors.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def drafter_forward(drafter, target, tokens, anchors, mask_id: int, block: int, device, ctx_dtype):
    """Logits [b, n, B, V] of the blocks at the anchors (position 0 is the bonus, unused)."""
    b, n = anchors.shape
    with torch.no_grad():
        out = target(input_ids=tokens, output_hidden_states=True)
        feats = context_features(out.hidden_states, drafter.config.target_layer_ids)
        embed = target.get_input_embeddings()
        block_ids = torch.full((b, n, block), mask_id, device=device)
        block_ids[:, :, 0] = torch.gather(tokens, 1, anchors)
        noise = embed(block_ids.reshape(b, n * block))
    L = tokens.shape[1]
    pos = torch.cat((torch.arange(L, device=device).expand(b, L),
                     (anchors[:, :, None] + torch.arange(block, device=device)).reshape(b, n * block)), dim=1)
    mask = block_mask(anchors, L, block, ctx_dtype)
    with autocast(device):
        hidden = drafter(noise, feats, pos, attention_mask=mask)
        logits = target.get_output_embeddings()(hidden)
    return logits.float().reshape(b, n, block, -1)


def block_loss(logits, labels, live, gamma: float):
    block = labels.shape[2]
    w = torch.exp(-torch.arange(block - 1, device=logits.device, dtype=torch.float32) / gamma)
    weights = live[:, :, 1:].float() * w
    ce = F.cross_entropy(logits[:, :, 1:].reshape(-1, logits.shape[-1]), labels[:, :, 1:].reshape(-1),
                         reduction="none").reshape(weights.shape)
    return (ce * weights).sum() / weights.sum().clamp(min=1.0)


def accept_lengths(logits, labels) -> torch.Tensor:
    """Chain tau per block: 1 (the bonus) + the run of leading drafts equal to the target's tokens."""
    hits = (logits[:, :, 1:].argmax(-1) == labels[:, :, 1:]).long()
    return 1 + hits.cumprod(dim=2).sum(dim=2)


@torch.no_grad()
def eval_drafter(drafter, target, s: SeqSet, r: DraftRecipe, mask_id: int, device, ctx_dtype, seed: int):
    drafter.eval()
    gen = torch.Generator().manual_seed(seed)
    taus, losses = [], []
    for i in range(0, s.tokens.shape[0], r.batch_size):
        idx = torch.arange(i, min(i + r.batch_size, s.tokens.shape[0]))
        anchors, ok = pick_anchors(s, idx, r.anchors, r.block_size, gen, full_blocks=True)
        labels, live = block_batch(s, idx, anchors, r.block_size)
        logits = drafter_forward(drafter, target, s.tokens[idx].to(device), anchors.to(device), mask_id,
                                 r.block_size, device, ctx_dtype)
        labels, live, ok = labels.to(device), live.to(device), ok.to(device)
        losses.append(block_loss(logits, labels, live & ok[:, :, None], r.gamma).item())
        taus.append(accept_lengths(logits, labels)[ok].float().cpu())
    drafter.train()
    tau = torch.cat(taus)
    hist = torch.bincount(tau.long(), minlength=r.block_size + 1)[1:].tolist()
    return {"loss": sum(losses) / len(losses), "tau": tau.mean().item(), "tau_hist": hist}


def draft_config(r: DraftRecipe, target, mask_id: int) -> DFlashConfig:
    from ddtree.engine.reference.drafter import default_target_layer_ids

    tc = target.config
    n_target = tc.num_hidden_layers
    ids = r.target_layer_ids or default_target_layer_ids(n_target, r.num_layers)
    rope_theta = getattr(tc, "rope_theta", None) or (getattr(tc, "rope_parameters", None) or {}).get("rope_theta", 1e6)
    return DFlashConfig(
        hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size, num_hidden_layers=r.num_layers,
        num_attention_heads=tc.num_attention_heads, num_key_value_heads=tc.num_key_value_heads,
        head_dim=tc.head_dim, vocab_size=tc.vocab_size, num_target_layers=n_target,
        target_layer_ids=tuple(ids), mask_token_id=mask_id, block_size=r.block_size,
        rms_norm_eps=tc.rms_norm_eps, rope_theta=float(rope_theta),
        max_position_embeddings=tc.max_position_embeddings,
        extra={"dflash_config": {"mask_token": "<|mask|>"}},
    )


def train_drafter(r: DraftRecipe, target, train_set: SeqSet, held_set: SeqSet, mask_id: int, device,
                  seed: int, log: Log, minutes: float | None, name: str, checkpoint: Path | None = None):
    torch.manual_seed(seed)
    cfg = draft_config(r, target, mask_id)
    drafter = DFlashDrafter(cfg).to(device)
    ctx_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n_params = sum(p.numel() for p in drafter.parameters())
    log(f"drafter {name}: {n_params / 1e6:.2f}M params, {r.num_layers} layers, target layers "
        f"{list(cfg.target_layer_ids)}, block {r.block_size}, {r.anchors} anchors/seq, {r.steps} steps x "
        f"{r.batch_size} seqs; data {train_set.tokens.shape[0]} seqs")
    opt = torch.optim.AdamW(drafter.parameters(), lr=r.lr, betas=(0.9, 0.95), weight_decay=0.01,
                            fused=device.type == "cuda")
    gen = torch.Generator().manual_seed(seed)
    n = train_set.tokens.shape[0]
    order = torch.randperm(n, generator=gen)
    cursor = 0
    curve = []
    t0 = time.perf_counter()
    drafter.train()
    plan = StepPlan(r.steps, minutes, r.warmup, log, f"drafter {name}")
    step = 0
    while step < plan.total:
        plan.tick(step)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, plan.total, r.warmup, r.lr)
        if cursor + r.batch_size > n:
            order, cursor = torch.randperm(n, generator=gen), 0
        idx = order[cursor:cursor + r.batch_size]
        cursor += r.batch_size
        anchors, ok = pick_anchors(train_set, idx, r.anchors, r.block_size, gen, full_blocks=False)
        labels, live = block_batch(train_set, idx, anchors, r.block_size)
        logits = drafter_forward(drafter, target, train_set.tokens[idx].to(device), anchors.to(device),
                                 mask_id, r.block_size, device, ctx_dtype)
        labels, live, ok = labels.to(device), live.to(device), ok.to(device)
        loss = block_loss(logits, labels, live & ok[:, :, None], r.gamma)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        last = step == plan.total - 1
        elapsed = time.perf_counter() - t0
        over = plan.over(elapsed)
        if step % r.eval_every == 0 or last or over:
            with torch.no_grad():
                tau_train = accept_lengths(logits, labels)[ok & live.all(2)].float().mean().item()
            ev = eval_drafter(drafter, target, held_set, r, mask_id, device, ctx_dtype, seed + 7)
            curve.append({"step": step, "loss": loss.item(), "tau_train_batch": tau_train, **ev})
            if checkpoint is not None:
                # A run cut short by its machine's time limit still leaves its latest drafter.
                save_drafter(copy.deepcopy(drafter).to(torch.bfloat16), checkpoint)
            log(f"drafter {name} step {step:5d} loss {loss.item():.3f} heldout loss {ev['loss']:.3f} "
                f"teacher-forced tau: heldout {ev['tau']:.2f} train-batch {tau_train:.2f} "
                f"({(step + 1) / elapsed:.1f} steps/s)")
        if over and not last:
            log(f"drafter {name}: stopped at step {step}, past its time budget (not the schedule's end)")
            break
        step += 1
    log(f"drafter {name}: heldout tau histogram (tau=1..{r.block_size}) {curve[-1]['tau_hist']}")
    return drafter.eval(), curve


# ---------------------------------------------------------------- command line


def parse_variant(text: str) -> tuple[int, tuple[int, ...] | None]:
    """'2' or '2:1,5' -> (draft layers, target layer ids or None for the default)."""
    layers, _, ids = text.partition(":")
    return int(layers), (tuple(int(x) for x in ids.split(",")) if ids else None)


def cmd_prepare(args) -> int:
    from ddtree.engine.reference.demo_data import prepare

    prepare(Path(args.data), vocab_size=args.vocab_size, heldout_percent=args.heldout_percent,
            max_files=args.max_files, prompts_path=Path(args.prompts) if args.prompts else None)
    return 0


def cmd_train(args) -> int:
    device = torch.device(args.device)
    data_dir, out = Path(args.data), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out / "train.log")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    manifest = json.loads((data_dir / "manifest.json").read_text())
    special = manifest["special_tokens"]
    vocab = manifest["vocab_size"]
    data = torch.load(data_dir / "data.pt")
    log(f"torch {torch.__version__} python {sys.version.split()[0]} device {device}"
        f"{' ' + torch.cuda.get_device_name(device) if device.type == 'cuda' else ''}; corpus from python "
        f"{manifest['python']}: {len(manifest['files'])} files, train {manifest['train_tokens']} tokens, "
        f"heldout {manifest['heldout_tokens']} tokens, vocab {vocab}")
    tr = TargetRecipe(hidden_size=args.hidden, num_hidden_layers=args.layers, intermediate_size=args.intermediate,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                      seq_len=args.seq_len, batch_size=args.batch, steps=args.target_steps, lr=args.target_lr,
                      eval_every=args.eval_every)
    gr = GenRecipe(num_train=args.gen_train, num_heldout=args.gen_heldout, gen_len=args.gen_len,
                   batch_size=args.gen_batch, prefix_lens=tuple(int(x) for x in args.prefix_lens.split(",")),
                   prompt_share=args.prompt_share, max_prompt_len=args.max_prompt_len)
    metrics: dict = {"target_recipe": asdict(tr), "gen_recipe": asdict(gr), "seed": args.seed}
    if args.target_from:
        from transformers import AutoModelForCausalLM

        target = AutoModelForCausalLM.from_pretrained(args.target_from, dtype=torch.float32).to(device).eval()
        log(f"target loaded from {args.target_from}")
    else:
        target, curve = train_target(tr, data, special, vocab, device, args.seed, log, args.target_minutes)
        metrics["target_curve"] = curve
        round_to_bf16(target)
        save_target(target, out / "target", None if args.no_tokenizer_copy else data_dir / "tokenizer", special)
        log(f"target saved to {out / 'target'}")
    for p in target.parameters():
        p.requires_grad_(False)
    eos, mask_id = special["<|endoftext|>"], special["<|mask|>"]
    train_prompts = split_prompts(data["train_prompts"], data["train_prompt_lens"], gr.max_prompt_len)
    held_prompts = split_prompts(data["heldout_prompts"], data["heldout_prompt_lens"], gr.max_prompt_len)
    train_set = generate_set(target, data["train"].long(), data["train_starts"], train_prompts, gr.num_train, gr,
                             device, args.seed + 11, eos, log, "train split")
    held_set = generate_set(target, data["heldout"].long(), data["heldout_starts"], held_prompts, gr.num_heldout,
                            gr, device, args.seed + 13, eos, log, "heldout split")
    best = None
    metrics["drafters"] = {}
    for variant in args.variants:
        layers, ids = parse_variant(variant)
        dr = DraftRecipe(num_layers=layers, target_layer_ids=ids, block_size=args.block_size, anchors=args.anchors,
                         batch_size=args.draft_batch, steps=args.draft_steps, lr=args.draft_lr,
                         gamma=args.gamma, eval_every=args.draft_eval_every)
        drafter, curve = train_drafter(dr, target, train_set, held_set, mask_id, device, args.seed + 17, log,
                                       args.drafter_minutes, variant,
                                       out / "drafter" if len(args.variants) == 1 else None)
        tau = curve[-1]["tau"]
        metrics["drafters"][variant] = {"recipe": asdict(dr), "curve": curve, "heldout_tau": tau}
        # Deeper drafters cost more per round on the CPU: prefer the smaller one unless clearly better.
        score = tau - 0.15 * layers
        if best is None or score > best[0]:
            best = (score, variant, drafter)
            save_drafter(drafter.to(torch.bfloat16), out / "drafter")
            drafter.float()
        (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    metrics["chosen"] = best[1]
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    log(f"chosen drafter {best[1]}; saved to {out / 'drafter'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ddtree.engine.reference.train_demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="corpus + tokenizer + token ids (+ prompt set) from this Python's stdlib")
    p.add_argument("--data", required=True)
    p.add_argument("--prompts", default=None, help="write the held-out prompt set here (jsonl)")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--heldout-percent", type=int, default=5)
    p.add_argument("--max-files", type=int, default=None, help="a small corpus for smoke tests")
    p.set_defaults(func=cmd_prepare)
    t = sub.add_parser("train", help="train the target and the drafter from a prepared folder")
    t.add_argument("--data", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    t.add_argument("--seed", type=int, default=1234)
    t.add_argument("--target-from", default=None, help="skip target training; load this HF directory")
    t.add_argument("--no-tokenizer-copy", action="store_true", help="write only config + weights for the target")
    d = TargetRecipe()
    t.add_argument("--hidden", type=int, default=d.hidden_size)
    t.add_argument("--layers", type=int, default=d.num_hidden_layers)
    t.add_argument("--heads", type=int, default=d.num_attention_heads)
    t.add_argument("--kv-heads", type=int, default=d.num_key_value_heads)
    t.add_argument("--head-dim", type=int, default=d.head_dim)
    t.add_argument("--intermediate", type=int, default=d.intermediate_size)
    t.add_argument("--seq-len", type=int, default=d.seq_len)
    t.add_argument("--batch", type=int, default=d.batch_size)
    t.add_argument("--target-steps", type=int, default=d.steps)
    t.add_argument("--target-lr", type=float, default=d.lr)
    t.add_argument("--eval-every", type=int, default=d.eval_every)
    t.add_argument("--target-minutes", type=float, default=None,
                   help="fit the step count to this time budget (the log prints the count to reproduce)")
    g = GenRecipe()
    t.add_argument("--gen-train", type=int, default=g.num_train)
    t.add_argument("--gen-heldout", type=int, default=g.num_heldout)
    t.add_argument("--gen-len", type=int, default=g.gen_len)
    t.add_argument("--gen-batch", type=int, default=g.batch_size)
    t.add_argument("--prefix-lens", default=",".join(map(str, g.prefix_lens)))
    t.add_argument("--prompt-share", type=float, default=g.prompt_share)
    t.add_argument("--max-prompt-len", type=int, default=g.max_prompt_len)
    r = DraftRecipe()
    t.add_argument("--variants", nargs="+", default=["2"], help="drafter variants: LAYERS[:TARGET_IDS], e.g. 2:1,5")
    t.add_argument("--block-size", type=int, default=r.block_size)
    t.add_argument("--anchors", type=int, default=r.anchors)
    t.add_argument("--draft-batch", type=int, default=r.batch_size)
    t.add_argument("--draft-steps", type=int, default=r.steps)
    t.add_argument("--draft-lr", type=float, default=r.lr)
    t.add_argument("--gamma", type=float, default=r.gamma)
    t.add_argument("--draft-eval-every", type=int, default=r.eval_every)
    t.add_argument("--drafter-minutes", type=float, default=None, help="the same, per drafter variant")
    t.set_defaults(func=cmd_train)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
