"""`runs` names the budget to serve with per run and setting, and the sentinel's flags, in text and JSON."""

import json

from ddtree.console import cli
from ddtree.store import open_db

from ..store.sentinel_support import store_run


def _runs(capsys, db_path, *argv):
    code = cli.main(["--db", str(db_path), "runs", *argv])
    out, _ = capsys.readouterr()
    assert code == 0
    return out


def test_runs_text_and_json_carry_the_recommendation_and_the_flags(tmp_path, capsys):
    db_path = tmp_path / "ddtree.db"
    with open_db(db_path) as db:
        fine = [store_run(db, scale=1 + 0.01 * (i - 1)) for i in range(3)]
        slow = store_run(db, scale=0.8)
    out = _runs(capsys, db_path).splitlines()
    assert f"run {slow} c=1: serve budget 32 at 96.0 tok/s (2.40x [" in "\n".join(out)
    flags = [line for line in out if line.startswith(f"run {slow} ! ")]
    assert flags[0].startswith(f"run {slow} ! c=1: budgets 8-64 20% slower than the last 3 runs")
    assert not any(line.startswith(f"run {fine[2]} ! ") for line in out)

    doc = {r["id"]: r for r in json.loads(_runs(capsys, db_path, "--json"))}
    [rec] = doc[slow]["recommendation"]
    assert rec["label"] == "c=1" and rec["state"] == "clear" and rec["budget"] == 32 and rec["decided"]
    assert rec["ratios"]["ar"]["value"] == 2.4 or abs(rec["ratios"]["ar"]["value"] - 2.4) < 0.01
    sentinel = doc[slow]["sentinel"]
    assert sentinel["flagged"] and sentinel["history"] == fine[::-1]
    assert {(f["metric"], f["algorithm"]) for f in sentinel["flags"]} == {("throughput", "ddtree"),
                                                                         ("throughput", "ar")}
    assert doc[fine[0]]["sentinel"]["history"] == [] and not doc[fine[2]]["sentinel"]["flagged"]
    assert doc[slow]["best_budget"][0]["label"] == "c=1"  # the verdict is still there
