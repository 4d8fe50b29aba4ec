"""Count the host-side work of a round: eager tensor ops and host syncs.

A CUDA graph replay is one driver call and dispatches no aten op, so under `HostWork` on CUDA
every op counted is a kernel launched (or a copy issued) outside the graphs: the round's fixed
cost on a launch-bound GPU. A sync is an op that brings a device value to the host (`.item()`,
`.tolist()`, `.cpu()`, `int(t)`): each one waits for the GPU to drain. `h2d` counts host-to-device
copies (`torch.tensor(..., device=...)`), which are synchronous from pageable memory.

On a CPU nothing is captured, so the counts include what the graphs would hold (bench reads
them on CUDA; tests/engine/reference/test_fast_round_host.py runs the graph-bound functions
outside the mode instead), and `.tolist()` of a CPU tensor moves nothing, so it is no sync.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops that read a device value on the host. tolist/item/int() go through _local_scalar_dense
# (one per element for tolist on some builds) or a copy to the CPU.
_SCALAR = {"aten::_local_scalar_dense", "aten::item"}
_COPIES = {"aten::_to_copy", "aten::copy_", "aten::to"}
# Metadata-only ops: no kernel, no launch.
_VIEWS = {"aten::view", "aten::_unsafe_view", "aten::slice", "aten::select", "aten::as_strided",
          "aten::detach", "aten::alias", "aten::t", "aten::transpose", "aten::permute",
          "aten::unsqueeze", "aten::squeeze", "aten::expand", "aten::split", "aten::split_with_sizes",
          "aten::chunk", "aten::unbind", "aten::lift_fresh", "aten::empty", "aten::empty_like",
          "aten::empty_strided", "aten::reshape", "aten::_reshape_alias", "aten::narrow",
          "aten::resolve_conj", "aten::resolve_neg", "aten::detach_"}


def _device_of(x):
    return x.device if isinstance(x, torch.Tensor) else None


class HostWork(TorchDispatchMode):
    """with HostWork() as work: ...; then work.launches, work.syncs, work.h2d, work.replays and
    work.ops (a Counter by op name). One at a time: it rebinds CUDAGraph.replay while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.launches = 0
        self.syncs = 0
        self.h2d = 0
        self.replays = 0  # CUDA graph replays (counted by wrapping CUDAGraph.replay meanwhile)
        self._replay = None

    def __enter__(self):
        graph_cls = getattr(torch.cuda, "CUDAGraph", None)
        if graph_cls is not None and self._replay is None:
            self._replay = graph_cls.replay
            work = self

            def replay(graph, *args, **kwargs):
                work.replays += 1
                return work._replay(graph, *args, **kwargs)
            graph_cls.replay = replay
        return super().__enter__()

    def __exit__(self, *exc):
        if self._replay is not None:
            torch.cuda.CUDAGraph.replay = self._replay
            self._replay = None
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        out = func(*args, **kwargs)
        if name in _VIEWS:
            return out
        self.ops[name.removeprefix("aten::")] += 1
        if name in _SCALAR:
            self.syncs += 1
            return out
        if name in _COPIES:
            src = _device_of(args[1] if name == "aten::copy_" else args[0])
            dst = _device_of(args[0] if name == "aten::copy_" else out)
            if src is not None and dst is not None and src.type != dst.type:
                if dst.type == "cpu":
                    self.syncs += 1
                    return out
                self.h2d += 1
                return out
        self.launches += 1
        return out

    def as_dict(self) -> dict:
        return {"eager_launches": self.launches, "host_syncs": self.syncs, "h2d_copies": self.h2d,
                "graph_replays": self.replays}
