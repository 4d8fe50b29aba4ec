"""Bad input over the CLI and recipes, table-driven: each case is refused with one line on stderr
starting `error:`, the right exit code, no traceback, and the store exactly as it was (a dump of
the database before and after). Recipes are refused before anything starts (no engine, no run row).
"""

import sqlite3

import pytest

from ddtree.console import cli

pytestmark = pytest.mark.timeout(120)

HUGE = "1180591620717411303424"  # 2**70: beyond SQLite's 64-bit integers

GOOD_PROMPTS = '{"prompt": "def f(x):"}\n'

# (id, argv, recipe body or None, exit code, text the error line contains). In argv, RECIPE is the
# recipe file written from the body, TMP the test's folder.
CASES = [
    # ids and arguments
    ("export-huge-id", ["export", HUGE], None, 2, "run id is at most"),
    ("show-huge-id", ["jobs", "show", HUGE], None, 2, "job id is at most"),
    ("logs-huge-id", ["jobs", "logs", HUGE], None, 2, "job id is at most"),
    ("cancel-huge-id", ["jobs", "cancel", HUGE], None, 2, "job id is at most"),
    ("resume-huge-id", ["sweep", "--resume", HUGE], None, 2, "run id is at most"),
    ("export-text-id", ["export", "x"], None, 2, "expected a run id"),
    ("export-zero-id", ["export", "0"], None, 2, "run id is >= 1"),
    ("export-format", ["export", "1", "--format", "xls"], None, 2, "invalid choice: 'xls'"),
    ("serve-device", ["serve", "--device", "tpu"], None, 2, "unknown device 'tpu'"),
    ("serve-port", ["serve", "--port", "99999"], None, 2, "port number"),
    ("jobs-limit", ["jobs", "--limit", "0"], None, 2, "at least 1"),
    ("runs-limit", ["runs", "--limit", "-1"], None, 2, "at least 1"),
    ("cancel-grace", ["jobs", "cancel", "1", "--grace", "-1"], None, 2, "--grace"),
    ("unknown-command", ["nope"], None, 2, "invalid choice: 'nope'"),
    # rows that are not there, specs that cannot run
    ("export-missing-run", ["export", "999"], None, 2, "no run with id 999"),
    ("show-missing-job", ["jobs", "show", "999"], None, 2, "no job with id 999"),
    ("logs-missing-job", ["jobs", "logs", "999"], None, 2, "no job with id 999"),
    ("cancel-missing-job", ["jobs", "cancel", "999"], None, 2, "no job with id 999"),
    ("resume-missing-run", ["sweep", "--resume", "999"], None, 2, "no run with id 999"),
    ("resume-dry-run", ["sweep", "--resume", "1", "--dry-run"], None, 2, "--dry-run applies"),
    ("sweep-nothing", ["sweep"], None, 2, "give one of a recipe file, --resume RUN_ID or --settle RUN_ID"),
    ("submit-kind", ["jobs", "submit", "nope"], None, 2, "unknown job kind 'nope'"),
    ("submit-json", ["jobs", "submit", "sleep", "--spec", "{bad"], None, 2, "--spec is not valid JSON"),
    ("submit-sleep", ["jobs", "submit", "sleep", "--spec", '{"seconds": -1}'], None, 2, "sleep seconds"),
    ("submit-missing-run", ["jobs", "submit", "sweep", "--spec", '{"run_id": 99999}'], None, 2, "no run with id 99999"),
    ("submit-huge-run", ["jobs", "submit", "sweep", "--spec", '{"run_id": %s}' % HUGE], None, 2, "run_id must be"),
    ("export-no-folder", ["export", "1", "-o", "TMP/nope/x.csv"], None, 2, "does not exist (create it first"),
    ("export-to-folder", ["export", "1", "-o", "TMP"], None, 2, "is a folder"),
    ("export-to-empty", ["export", "1", "-o", ""], None, 2, "-o/--output: expected a path"),
    ("download-local-dir-file", ["download", "org/model", "--local-dir", "TMP/prompts.jsonl"], None, 2,
     "not a directory"),
    # recipes
    ("recipe-missing", ["sweep", "TMP/missing.toml"], None, 2, "(the shipped ones are in assets/recipes)"),
    ("recipe-toml", ["sweep", "RECIPE"], 'name = "x\n', 2, "is not valid TOML"),
    ("recipe-no-name", ["sweep", "RECIPE"], "[sweep]\nconcurrency = 1\n", 2, "missing key 'name'"),
    ("recipe-unknown-key", ["sweep", "RECIPE"], 'name = "x"\n[sweep]\nconcurency = 1\n', 2, "unknown key"),
    ("recipe-kind", ["sweep", "RECIPE"], 'name = "x"\n[engine]\nkind = "tgi"\n', 2, "engine.kind"),
    ("budget-5000", ["sweep", "RECIPE"], 'name = "x"\n[sweep]\nbudget = [5000]\n', 2, "sweep.budget[0] must be <= 1024"),
    ("budget-2-70", ["sweep", "RECIPE"], f'name = "x"\n[sweep]\nbudget = [{HUGE}]\n', 2, "sweep.budget"),
    ("engine-budget", ["sweep", "RECIPE"], 'name = "x"\n[engine]\nbudget = 4096\n', 2, "engine.budget must be <= 1024"),
    ("budget-with-ar", ["sweep", "RECIPE"], 'name = "x"\n[engine]\nalgorithm = "ar"\n[sweep]\nbudget = [4]\n', 2,
     "sweep.budget is set"),
    ("temperature-inf", ["sweep", "RECIPE"], 'name = "x"\n[sweep]\ntemperature = inf\n', 2, "sweep.temperature"),
    ("temperature-nan", ["sweep", "RECIPE"], 'name = "x"\n[sweep]\ntemperature = nan\n', 2, "sweep.temperature"),
    ("temperature-negative", ["sweep", "RECIPE"], 'name = "x"\n[sweep]\ntemperature = -1.0\n', 2,
     "sweep.temperature"),
    ("max-new-tokens", ["sweep", "RECIPE"], 'name = "x"\n[sweep]\nmax_new_tokens = 1000000000000\n', 2,
     "sweep.max_new_tokens must be <="),
    ("num-prompts", ["sweep", "RECIPE"], 'name = "x"\n[sweep]\nnum_prompts = 1099511627776\n', 2,
     "sweep.num_prompts must be <="),
    ("concurrency-zero", ["sweep", "RECIPE"], 'name = "x"\n[sweep]\nconcurrency = [0]\n', 2, "sweep.concurrency"),
    ("concurrency-huge", ["sweep", "RECIPE"], f'name = "x"\n[sweep]\nconcurrency = {HUGE}\n', 2, "sweep.concurrency"),
    ("repeats-zero", ["sweep", "RECIPE"], 'name = "x"\n[sweep]\nrepeats = 0\n', 2, "sweep.repeats"),
    ("prompts-missing", ["sweep", "RECIPE"], 'name = "x"\n[sweep]\ndataset = "TMP/nope.jsonl"\n', 2,
     "prompt file not found"),
    ("prompts-bad-jsonl", ["sweep", "RECIPE"], 'name = "x"\n[sweep]\ndataset = "TMP/bad.jsonl"\n', 2,
     "is not JSON"),
    ("prompts-empty", ["sweep", "RECIPE"], 'name = "x"\n[sweep]\ndataset = "TMP/empty.jsonl"\n', 2,
     "sweep.dataset"),
    ("prompts-binary", ["sweep", "RECIPE"], 'name = "x"\n[sweep]\ndataset = "TMP/binary.jsonl"\n', 2,
     "sweep.dataset"),
    ("model-missing", ["sweep", "RECIPE"], 'name = "x"\n[engine]\nmodel = "/nonexistent/model"\n', 2,
     "engine.model = '/nonexistent/model'"),
    ("draft-missing", ["sweep", "RECIPE"], 'name = "x"\n[engine]\nmodel = "TMP"\ndraft_model = "./no/such/drafter"\n',
     2, "engine.draft_model"),
    ("grid-too-large", ["sweep", "RECIPE"],
     'name = "x"\n[sweep]\nbudget = [%s]\nconcurrency = [%s]\n' % (", ".join(map(str, range(1000))),
                                                                    ", ".join(map(str, range(1, 101)))),
     2, "sweep grid has 100,000 points"),
    ("grid-too-large-dry-run", ["sweep", "RECIPE", "--dry-run"],
     'name = "x"\n[sweep]\nbudget = [%s]\nrepeats = 20\n' % ", ".join(map(str, range(1000))),
     2, "--yes-large"),
]


@pytest.fixture
def store(tmp_path):
    """A store with one run and one finished job in it, plus prompt files good and bad."""
    from ddtree.jobs.model import create_job, set_state
    from ddtree.store import open_db, sweeps

    db_path = tmp_path / "d.db"
    with open_db(db_path) as db:
        sweeps.create_run(db, job_id=None, name="kept", recipe={"name": "kept"}, engine_kind="builtin",
                          points_total=0)
        job = create_job(db, "sleep", {"seconds": 0.0, "fail": False, "message": ""}, name="kept")
        for state in ("starting", "running", "succeeded"):
            set_state(db, job, state)
    (tmp_path / "prompts.jsonl").write_text(GOOD_PROMPTS)
    (tmp_path / "bad.jsonl").write_text(GOOD_PROMPTS + "{not json\n")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "binary.jsonl").write_bytes(bytes(range(256)) * 4)
    return db_path


def dump(db_path) -> str:
    conn = sqlite3.connect(db_path)
    try:
        return "\n".join(conn.iterdump())
    finally:
        conn.close()


@pytest.mark.parametrize("case_id, argv, recipe, code, expected", CASES, ids=[c[0] for c in CASES])
def test_bad_input(store, tmp_path, capsys, case_id, argv, recipe, code, expected):
    if recipe is not None:
        (tmp_path / "r.toml").write_text(recipe.replace("TMP", str(tmp_path)))
    argv = [a.replace("RECIPE", str(tmp_path / "r.toml")).replace("TMP", str(tmp_path)) for a in argv]
    before = dump(store)
    try:
        got = cli.main(["--db", str(store), *argv])
    except SystemExit as exit_:  # argparse's own errors
        got = exit_.code
    out, err = capsys.readouterr()
    assert got == code, (case_id, err)
    assert err.startswith("error: ") and err.count("\n") == 1, (case_id, err)
    assert "Traceback" not in err and expected in err, (case_id, err)
    assert dump(store) == before, case_id


def test_the_table_is_large_enough():
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)
