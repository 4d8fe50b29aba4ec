"""A Triton compile after the server's warm-up is logged, with its kernel and time (a stream
waited for it); one inside a warm-up is not."""

import logging

import pytest

from ddtree.engine.reference.fast import graphs

knobs = pytest.importorskip("triton.knobs")


def test_compiles_after_the_warm_up_are_logged_and_kept(monkeypatch, caplog):
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    monkeypatch.setattr(graphs, "late_compiles", [])
    monkeypatch.setattr(graphs, "watching", False)
    log = logging.getLogger("test.late")
    assert graphs.watch_late_compiles(log) and graphs.watching
    before, after = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    kernel = "_rope_write_kernel[num_warps=4](x: *fp32, n: i32)"
    with graphs.warmup_scope():
        assert before(key="a", repr=kernel) is False and after(key="a", repr=kernel) is False
    assert graphs.late_compiles == []
    with caplog.at_level(logging.WARNING, logger="test.late"):
        assert before(key="b", repr=kernel) is False and after(key="b", repr=kernel) is False
    assert [name for name, _ in graphs.late_compiles] == ["_rope_write_kernel"]
    assert graphs.late_compiles[0][1] >= 0
    assert "Triton compiled _rope_write_kernel while serving" in caplog.text
    after(key="never-started", repr=kernel)  # a post hook without its start: nothing to time
    assert len(graphs.late_compiles) == 1
    assert graphs.watch_late_compiles(log) and knobs.runtime.jit_cache_hook is before  # one watch


def test_hooks_set_before_are_still_called_and_answer(monkeypatch):
    calls = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: calls.append(("before", kw["key"])) or True)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: calls.append(("after", kw["key"])))
    monkeypatch.setattr(graphs, "late_compiles", [])
    monkeypatch.setattr(graphs, "watching", False)
    assert graphs.watch_late_compiles(logging.getLogger("test.late"))
    assert knobs.runtime.jit_cache_hook(key="k", repr="kern[]()", fn=None) is True  # theirs: skip it
    knobs.runtime.jit_post_compile_hook(key="k", repr="kern[]()", fn=None)
    assert calls == [("before", "k"), ("after", "k")]
