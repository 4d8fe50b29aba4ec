"""The regression sentinel: a planted regression is flagged, a run within noise is not."""

from types import SimpleNamespace

import pytest

from ddtree.store import open_db
from ddtree.store.queries import get_run
from ddtree.store.sentinel import check_run, check_runs, hardware_identity, run_fingerprint, sentinel

from .insight_support import points
from .sentinel_support import HARDWARE, SOFTWARE, store_run

TAU = {8: 3.6, 16: 4.0, 32: 4.3, 64: 4.5}


def _run(run_id, driver="575", torch="2.13", model="m"):
    return SimpleNamespace(id=run_id, model=model, draft_model="d", engine_kind="builtin", recipe={},
                           hardware={**HARDWARE, "driver_version": driver},
                           software={"packages": {"ddtree-console": "0.3", "torch": torch}})


def _points(scale=1.0, tau_fall=(), wobble=0.0):
    out = []
    for budget, tau in TAU.items():
        toks = [(100 + budget / 10) * scale * (1 + wobble) + d for d in (0, 1, -1)]
        out += points({("ddtree", budget): toks}, tau=tau * 0.5 if budget in tau_fall else tau)
    return out + points({("ar", None): [50 * scale, 50.5 * scale, 49.5 * scale]})


def _history():
    return [(_run(i), _points(1 + 0.01 * (i % 3 - 1))) for i in range(1, 6)]


def test_a_run_within_noise_raises_no_flag():
    report = sentinel(_run(9), _points(1.01, wobble=0.004), _history())
    assert report.flags == () and not report.flagged
    assert report.history == (5, 4, 3, 2, 1) and report.checked == 9 and report.unchecked == 0
    assert report.short == "ok vs 5" and report.lines == []


def test_a_planted_slowdown_is_flagged_with_its_size_and_likely_cause():
    report = sentinel(_run(9, driver="580"), _points(0.82), _history())
    assert {(f.metric, f.algorithm) for f in report.flags} == {("throughput", "ddtree"), ("throughput", "ar")}
    assert all(-19 < f.change_pct < -17 for f in report.flags)
    lines = report.lines
    assert lines[0].startswith("c=1: budgets 8-64 18% slower than the last 5 runs (")
    assert lines[1].startswith("c=1: AR 18% slower than the last 5 runs")
    assert lines[-1] == "changed since the last run: driver 575 -> 580"
    assert report.to_dict()["flagged"] is True and report.short == "⚠ c=1: budgets 8-64 18% slower than the last 5 runs (+1)"


def test_tau_collapsing_at_large_budgets_is_named_so():
    report = sentinel(_run(9), _points(tau_fall=(32, 64)), _history())
    assert [(f.metric, f.budget) for f in report.flags] == [("tau", 32), ("tau", 64)]
    assert report.lines == ["c=1: tau collapsed at budget >= 32 (4.30 -> 2.15 at budget 32, against the last 5 runs)"]


def test_other_fingerprints_and_later_runs_are_not_history():
    history = [(_run(i, model="other"), _points()) for i in range(1, 4)] + [(_run(12), _points())]
    report = sentinel(_run(9), _points(0.5), history)
    assert report.history == () and report.flags == () and report.short == ""
    # a driver or torch update keeps the fingerprint: it is what the sentinel must catch
    assert run_fingerprint(_run(1, driver="580", torch="2.14")).key == run_fingerprint(_run(1)).key
    assert hardware_identity({**HARDWARE, "host": {**HARDWARE["host"], "hostname": "b"}}) == hardware_identity(HARDWARE)


def test_single_repeats_and_one_earlier_run_are_unchecked_not_flagged():
    one = [(_run(1), [p for p in _points() if p.repeat == 0])]
    report = sentinel(_run(9), [p for p in _points(0.5) if p.repeat == 0], one)
    assert report.flags == () and report.checked == 0 and report.unchecked == 9


def test_one_earlier_run_with_repeats_is_enough_for_a_clear_regression():
    report = sentinel(_run(9), _points(0.8), [(_run(1), _points())])
    assert report.flagged and report.lines[0].startswith("c=1: budgets 8-64 20% slower than the last run")


def test_the_store_reads_the_history_of_the_fingerprint(tmp_path):
    with open_db(tmp_path / "s.db") as db:
        old = [store_run(db, scale=1 + 0.01 * (i % 3 - 1)) for i in range(4)]
        store_run(db, model="another/model", scale=0.5)
        store_run(db, hardware={**HARDWARE, "gpus": HARDWARE["gpus"] * 2}, scale=0.5)
        fine = store_run(db, scale=1.005)
        slow = store_run(db, scale=0.8, software={**SOFTWARE, "packages": {**SOFTWARE["packages"], "torch": "2.14.0"}})
        collapsed = store_run(db, tau_scale={32: 0.6, 64: 0.5})
        report = check_run(db, get_run(db, slow))
        assert report.flagged and report.history[:4] == (fine, *reversed(old[1:]))
        assert "torch 2.13.0 -> 2.14.0" in report.lines[-1]
        many = check_runs(db, [old[0], fine, slow, collapsed, 999])
        assert set(many) == {old[0], fine, slow, collapsed}
        assert many[old[0]].history == () and not many[fine].flagged and many[slow].flagged
        assert many[collapsed].lines[0].startswith("c=1: tau collapsed at budget >= 32")
        assert many[slow].to_dict()["flags"] == check_run(db, get_run(db, slow)).to_dict()["flags"]


@pytest.mark.parametrize("scale", [0.99, 1.0, 1.01])
def test_small_wobbles_never_flag(scale):
    assert not sentinel(_run(9), _points(scale), _history()).flagged
