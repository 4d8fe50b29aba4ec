"""cuBLAS's workspace for the fast backend's products.

A DDTree verify runs each layer's products at 17-257 rows. With torch's default workspace cuBLAS
splits the 8B down product's inner dimension at those rows (and some of the drafter's) and adds
a reduce kernel after each: 52 more kernels a DDTree-64 round. With a 1 KiB workspace split-K
has no room, and cuBLAS picks kernels that need no reduce. Measured on an H100 (bench/RESULTS.md,
`PART=blas bash bench/gpu_rows_8b.sh`: torch's workspace against this one, A B A B in one call),
ms a round: 8B DDTree-64 9.69 / 9.68 against 9.51 / 9.31, DDTree-32 9.20 / 9.23 against
8.98 / 8.82, DFlash 8.93 / 8.79 against 8.49 / 8.53; the AR step (its one-row products on our
GEMV kernel) unchanged. bench_cublas_rows.py's layer products: 2-5% faster from 33 to 129 rows,
no slower at 1 and 17.
Not measured: the 1.7B shape's rounds and the batched ones.

torch reads CUBLAS_WORKSPACE_CONFIG once, at cuBLAS's first use in the process, so this is asked
for before the fast backend builds anything, and a value the environment already holds wins.
"""

from __future__ import annotations

import os

SMALL_WORKSPACE = ":1:1"  # one buffer of 1 KiB
#: False leaves torch's own default (the benches' A/B: profile_round.py --blas torch).
wanted = True


def ask_small_workspace() -> str | None:
    """The CUBLAS_WORKSPACE_CONFIG this process runs with: SMALL_WORKSPACE unless the environment
    set one first (kept) or `wanted` is off (None: torch's default). It takes effect only if no
    cuBLAS call has run in this process yet."""
    if wanted:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", SMALL_WORKSPACE)
    return os.environ.get("CUBLAS_WORKSPACE_CONFIG")
