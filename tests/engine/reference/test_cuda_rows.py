"""RowLinears on CUDA: tune measures the few-row float32 shapes, and whichever way it picks for
each, the product equals F.linear. Run on the H200 by the lead; skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ddtree.engine.reference.fast.gemv import RowsConfig
from ddtree.engine.reference.fast.rows import RowLinears

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_tune_measures_few_row_float32_shapes_and_every_choice_computes_the_linear():
    device = torch.device("cuda")
    torch.manual_seed(0)
    linears = [torch.nn.Linear(k, n, bias=bias).to(device) for k, n, bias in
               ((256, 128, False), (256, 256, False), (768, 256, True), (256, 4096, False))]
    rows = RowLinears(device, torch.float32)
    assert rows.kernels  # the default (Gemv.rows says why)
    rows.tune(linears, [1, 2, 8, 16, 17])
    # Up to 16 rows the swap is tried, and the few-row kernel (fast/gemv.py) up to gemv.ROWS_MAX.
    assert set(rows.measured) == {(m, lin.in_features, lin.out_features) for lin in linears for m in (2, 8, 16, 17)}
    assert rows.swap <= set(rows.measured) and set(rows.kernel) <= set(rows.measured)
    assert not rows.swap & set(rows.kernel)
    # What tune chose, then every shape swapped, then every shape on the kernel.
    everything = {key: RowsConfig(16, 32, 64, 4) for key in rows.measured}
    for swap, kernel in ((set(rows.swap), dict(rows.kernel)), ({k for k in rows.measured if k[0] <= 16}, {}),
                         (set(), everything)):
        rows.swap, rows.kernel = swap, kernel
        for lin in linears:
            for m in (1, 2, 8, 16, 17):
                x = torch.randn(m, lin.in_features, device=device)
                torch.testing.assert_close(rows(lin, x), F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
    during = RowLinears(device, torch.float32)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        during.tune(linears, [4])  # inside a capture it must not time (or sync) anything
    assert during.measured == {}
    bf16 = RowLinears(device, torch.bfloat16)
    bf16.tune(linears, [16])
    assert not bf16.active and bf16.measured == {}
