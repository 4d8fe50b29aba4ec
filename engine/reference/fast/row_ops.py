"""What DecoderLayer does around a product of many rows (a verify, a batched round, a prefill),
in fewer launches on CUDA: silu(gate) * up and the RMSNorm as one Triton kernel each, the residual
add in the GEMM's epilogue (addmm).

Why: in an H200 profile of a 16-session AR round on the 1.7B shape (bench/RESULTS.md, batched
prefills), the uncompiled layer spent 204 us a round in 57 RMSNorm kernels, 81 us in 56 residual
adds, and a gap of about a microsecond between any two of its 464 kernels. One-row products fold
these into the GEMV kernel (fast/gemv.py), and a compiled layer fuses them with Inductor; the
batched rounds and prefills run neither, so these take their place there. Compiled code keeps
the torch ops, which Inductor fuses better.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ddtree.engine.reference.fast import tree_attention

_SILU_BLOCK = 1024


def runs(x: torch.Tensor) -> bool:
    """Whether Gemv sends a product of x [n, K] here: bf16 or fp16 on CUDA with triton, outside a
    torch.compile trace. (The tests call the functions below on CPU tensors, in Triton's
    interpreter.)

    is_compiling comes first: traced, the rest (find_spec behind a cache) broke the compiled
    layer's graph at every product, and each piece then recompiled for every query bucket (the
    H200's recompile log, bench/RESULTS.md). float32 (the demo pair) keeps the torch ops: in the one
    demo grid run with these on, AR at 16 sessions ran 27% below the grid before (not isolated).
    """
    if torch.compiler.is_compiling():
        return False
    return (x.dim() == 2 and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and tree_attention.available())


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [n, 2I] (the fused [gate; up]) -> silu(gate) * up [n, I]."""
    from ddtree.engine.reference.fast.triton_row_ops import silu_mul as kernel

    n, inner = x.shape[0], x.shape[1] // 2
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty((n, inner), dtype=x.dtype, device=x.device)
    kernel[(n, -(-inner // _SILU_BLOCK))](x, out, inner, x.stride(0), out.stride(0), BLOCK=_SILU_BLOCK,
                                           num_warps=4)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [n, H] normed over H and scaled by weight [H]."""
    from ddtree.engine.reference.fast.triton_row_ops import rms_norm as kernel

    n, width = x.shape
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty_like(x)
    block = 1 << (width - 1).bit_length()
    kernel[(n,)](x, weight, out, width, float(eps), x.stride(0), out.stride(0), BLOCK=block,
                 num_warps=max(1, min(16, block // 256)))
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], pre, residual: Optional[torch.Tensor],
           before) -> torch.Tensor:
    """gemv.plain's result with the kernels above: `before(x, pre)` for what they do not take."""
    from ddtree.engine.reference.fast.model import RMSNorm

    if pre == "silu":
        x = silu_mul(x)
    elif isinstance(pre, RMSNorm) and pre.weight is not None:
        x = rms_norm(x, pre.weight, pre.eps)
    else:
        x = before(x, pre)
    if residual is not None and bias is None and residual.dtype == x.dtype:
        return torch.addmm(residual, x, weight.t())
    out = F.linear(x, weight, bias)
    return out if residual is None else residual + out

