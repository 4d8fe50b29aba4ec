"""Recording a CUDA graph, the one way every graph of the fast backend is recorded."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

# Warm-ups under way (FastPath.warmup). torch.compile'd code runs only inside them: there every
# shape the warm-up's captures need compiles once, before the server takes requests. Anything
# later, a forward with no graph or a graph captured on first use (a longer context, a prefill
# bucket), runs uncompiled: on an H200 the demo pair's warm-up logs its recompiles about 6 s apart
# (bench/RESULTS.md), and mid-serving every stream would wait through one.
# Per thread: a warm-up runs on the thread that calls it, and another engine's rounds on another
# thread of the process must not compile meanwhile.
_state = threading.local()


def warming_up() -> bool:
    """Whether an engine warm-up is under way on this thread."""
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def warmup_scope() -> Iterator[None]:
    """Mark the code inside as a warm-up (FastPath.warmup; tests on a CPU)."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def record_graph(fn, pool, device, runs: int, inference: bool = False):
    """fn warmed up `runs` times on a side stream (lazy kernel, cuBLAS and compile work stays out
    of the graph, as torch.cuda.graph's notes ask), then captured into a graph of this memory
    pool: (graph, what fn returned during the capture: the tensors each replay rewrites).
    inference: do both under torch.inference_mode (what writes inference tensors needs it)."""
    context = torch.inference_mode() if inference else contextlib.nullcontext()
    with context:
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device=device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(runs):
                fn()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
    return graph, out


# Triton kernels compiled since watch_late_compiles() and outside a warm-up: (name, seconds);
# and whether anything watches.
late_compiles: list[tuple[str, float]] = []
watching = False


def watch_late_compiles(log) -> bool:
    """After a server's warm-up: log every Triton kernel specialisation that compiles later (a
    stream waits for each, up to a second on an H200 when the kernel cache is cold), with its
    time, and keep it in late_compiles. False where this Triton has no such hooks."""
    global watching
    try:
        from triton import knobs
    except ImportError:
        return False
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_cache_hook") or not hasattr(runtime, "jit_post_compile_hook"):
        return False
    if watching:  # a second warm-up in this process (a bench's in-process engine): one watch
        return True
    started: dict[str, float] = {}
    # Hooks someone set before (torch may): still called, and their answer kept.
    earlier_before, earlier_after = runtime.jit_cache_hook, runtime.jit_post_compile_hook

    def before(*, key, repr, **rest):
        import time

        started[str(key)] = time.perf_counter()
        # True would make Triton skip the compile: only an earlier hook may ask for that.
        return earlier_before(key=key, repr=repr, **rest) if earlier_before else False

    def after(*, key, repr, **rest):
        import time

        answer = earlier_after(key=key, repr=repr, **rest) if earlier_after else False
        t0 = started.pop(str(key), None)
        if t0 is not None and not warming_up():
            seconds = time.perf_counter() - t0
            late_compiles.append((repr.split("[", 1)[0], seconds))
            log.warning("Triton compiled %s while serving (%.2f s; the warm-up did not meet this shape): %s",
                        repr.split("[", 1)[0], seconds, repr)
        return answer

    runtime.jit_cache_hook = before
    runtime.jit_post_compile_hook = after
    watching = True
    return True


class Staging:
    """A graph's device input filled from the host without waiting for the GPU. A plain copy
    from pageable memory synchronizes the stream, so a round staged behind a queued prefill
    would wait for all of it; this one goes through pinned memory, copied without blocking, and
    a rewrite waits only for the last copy out of it (an event), not for the work queued before."""

    def __init__(self, device_buffer: torch.Tensor) -> None:
        self.device_buffer = device_buffer
        cuda = device_buffer.is_cuda
        self.host = torch.zeros(device_buffer.shape, dtype=device_buffer.dtype, pin_memory=cuda)
        self._copied = torch.cuda.Event() if cuda else None

    def write(self) -> torch.Tensor:
        """The host buffer, free to fill once the last upload from it has run."""
        if self._copied is not None:
            self._copied.synchronize()
        return self.host

    def upload(self) -> None:
        """Queue the host buffer's copy into the device buffer."""
        self.device_buffer.copy_(self.host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
