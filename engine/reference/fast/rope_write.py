"""A forward's new queries and keys normed and rotated, and its keys and values written to the
cache, in one kernel (Triton) on the static paths.

Why: in an H200 profile of the Qwen3-8B AR step (bench/RESULTS.md, fifth pass) the compiled
layer ran this work as five kernels (the q norm, the k norm, k's RoPE with its cache write, q's
RoPE, v's cache write) of about 1.2 us each, plus the gaps between them in a graph replay: some
9 us a layer, 0.3 ms a step. The norms are two reductions over different heads and the writes
are in-place index copies, which torch.compile does not fuse. Here one program takes one token's
head: a query or key head is normed (Qwen3's q_norm/k_norm, when the model has them) and rotated,
queries come back as the output, keys and values go straight to their cache rows (and, for a
packed prefill's flash attention, which reads them beside the queries, into the output too).

The arithmetic is model.RMSNorm's CUDA path (float32 statistics, one rounding after the weight)
and the rolled RoPE form of model.Attention, in float32 rounded once, as the compiled layer's
fused kernels compute it.
"""

from __future__ import annotations

from typing import Optional

import torch


def launch(qkv: torch.Tensor, q_weight: Optional[torch.Tensor], k_weight: Optional[torch.Tensor],
           cos: torch.Tensor, sin: torch.Tensor, eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor,
           slots: Optional[torch.Tensor], rows: torch.Tensor, heads: int, kv_heads: int,
           kv_out: bool = False) -> torch.Tensor:
    """qkv [n, (heads + 2 kv_heads) * d]; cos/sin [n, 1, d]; caches [kv_heads, R, d] (one cache)
    or [S, kv_heads, R, d] (a pool, with slots [n]); rows [n] -> queries [n, heads, d], or with
    kv_out queries, keys and values [n, heads + 2 kv_heads, d]."""
    from ddtree.engine.reference.fast.triton_rope import rope_write

    n = qkv.shape[0]
    d = cos.shape[-1]
    qkv = qkv.contiguous()
    cos, sin = cos.reshape(n, d).contiguous(), sin.reshape(n, d).contiguous()
    out = torch.empty((n, heads + 2 * kv_heads if kv_out else heads, d), dtype=qkv.dtype, device=qkv.device)
    kc = k_cache if k_cache.dim() == 4 else k_cache[None]
    vc = v_cache if v_cache.dim() == 4 else v_cache[None]
    norm = q_weight is not None
    rope_write[(n, heads + 2 * kv_heads)](
        qkv, q_weight if norm else qkv, k_weight if norm else qkv, cos, sin, kc, vc,
        slots if slots is not None else rows, rows, out, heads, kv_heads, float(eps),
        qkv.stride(0), cos.stride(0), kc.stride(0), kc.stride(1), kc.stride(2),
        vc.stride(0), vc.stride(1), vc.stride(2), out.stride(0), out.stride(1),
        D=d, HAS_NORM=norm, HAS_SLOTS=slots is not None, KV_OUT=kv_out, num_warps=1)
    return out


@torch.library.custom_op("ddtree::rope_write", mutates_args=("k_cache", "v_cache"))
def _rope_write(qkv: torch.Tensor, q_weight: Optional[torch.Tensor], k_weight: Optional[torch.Tensor],
                cos: torch.Tensor, sin: torch.Tensor, eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor,
                slots: Optional[torch.Tensor], rows: torch.Tensor, heads: int, kv_heads: int,
                kv_out: bool = False) -> torch.Tensor:
    return launch(qkv, q_weight, k_weight, cos, sin, eps, k_cache, v_cache, slots, rows, heads, kv_heads, kv_out)


@_rope_write.register_fake
def _(qkv, q_weight, k_weight, cos, sin, eps, k_cache, v_cache, slots, rows, heads, kv_heads, kv_out=False):
    return qkv.new_empty((qkv.shape[0], heads + 2 * kv_heads if kv_out else heads, cos.shape[-1]))


def rope_write(qkv, q_weight, k_weight, cos, sin, eps, k_cache, v_cache, slots, rows, heads, kv_heads,
               kv_out=False):
    """launch's work as a custom op (torch.compile'd layers call it as it is, writing the caches
    in place)."""
    return torch.ops.ddtree.rope_write(qkv, q_weight, k_weight, cos, sin, eps, k_cache, v_cache, slots, rows,
                                       heads, kv_heads, kv_out)
