import hashlib
import os
import sqlite3
import stat
import subprocess
import sys
import textwrap

import pytest

from ddtree.store import data_dir, default_db_path, open_db
from ddtree.store.db import open_existing, open_read_only, resolve_db_path, schema_version
from ddtree.store.errors import CorruptDatabase, DatabasePathError, ForeignDatabase, NotFound
from ddtree.store.migrations import migrations
from ddtree.store.queries import get_job, get_run, insert_row, list_runs, update_row

TABLES = {"jobs", "job_events", "processes", "downloads", "engines", "runs", "points", "requests", "telemetry"}


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_new_database_is_private_wal_and_has_every_table(tmp_path):
    path = tmp_path / "deep" / "er" / "ddtree.db"
    db = open_db(path)
    assert TABLES <= set(db.table_names())
    assert db.journal_mode == "wal"
    assert db.execute("PRAGMA busy_timeout").fetchone()[0] >= 10_000
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert not migrations.pending(db)
    assert data_dir(path) == path.parent
    db.close()


def test_reopening_applies_nothing_and_keeps_rows(tmp_path):
    path = tmp_path / "d.db"
    db = open_db(path)
    insert_row(db, "runs", {"name": "a", "created_at": 1.0})
    applied = [m.name for m in migrations.applied(db)]
    db.close()
    db = open_db(path)
    assert [m.name for m in migrations.applied(db)] == applied
    assert [r.name for r in list_runs(db)] == ["a"]


def test_default_path_follows_env(monkeypatch, tmp_path):
    monkeypatch.delenv("DDTREE_DB", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert default_db_path() == tmp_path / "xdg" / "ddtree-console" / "ddtree.db"
    monkeypatch.setenv("DDTREE_DB", str(tmp_path / "env.db"))
    assert resolve_db_path(None) == tmp_path / "env.db"
    assert resolve_db_path(tmp_path / "arg.db") == tmp_path / "arg.db"
    open_db().close()
    assert (tmp_path / "env.db").exists()


def test_file_that_is_not_sqlite_is_refused_and_untouched(tmp_path):
    path = tmp_path / "ddtree.db"
    path.write_bytes(b"hello, this is a text file and not a database\n" * 50)
    before = digest(path)
    with pytest.raises(CorruptDatabase) as err:
        open_db(path)
    assert "not a SQLite database" in err.value.message and err.value.hint
    assert err.value.exit_code == 2
    assert digest(path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ddtree.db"]


def test_damaged_sqlite_file_is_refused_and_untouched(tmp_path):
    path = tmp_path / "ddtree.db"
    open_db(path).close()
    data = bytearray(path.read_bytes())
    data[100:4096] = os.urandom(4096 - 100)  # keep the magic, destroy the schema page
    path.write_bytes(bytes(data))
    before = digest(path)
    with pytest.raises(CorruptDatabase):
        open_db(path)
    assert digest(path) == before


def test_foreign_sqlite_database_is_refused_and_untouched(tmp_path):
    path = tmp_path / "other.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)")
    conn.execute("INSERT INTO customers (name) VALUES ('x')")
    conn.commit()
    conn.close()
    before = digest(path)
    with pytest.raises(ForeignDatabase) as err:
        open_db(path)
    assert "customers" in err.value.message
    assert digest(path) == before


def test_empty_file_becomes_a_database(tmp_path):
    path = tmp_path / "empty.db"
    path.touch()
    assert TABLES <= set(open_db(path).table_names())


def test_path_that_is_a_folder_or_under_a_file(tmp_path):
    with pytest.raises(DatabasePathError):
        open_db(tmp_path)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(DatabasePathError) as err:
        open_db(tmp_path / "afile" / "sub" / "d.db")
    assert err.value.exit_code == 2


def test_unwritable_folder(tmp_path):
    if os.geteuid() == 0:
        parent = "/sys"  # refuses new files even for root
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        parent = str(ro)
    with pytest.raises(DatabasePathError) as err:
        open_db(os.path.join(parent, "ddtree.db"))
    assert "writable" in err.value.hint
    with pytest.raises(DatabasePathError):
        open_db(os.path.join(parent, "missing", "ddtree.db"))


def test_update_and_lookup_errors(tmp_path):
    db = open_db(tmp_path / "d.db")
    rid = insert_row(db, "runs", {"name": "x", "created_at": 1.0, "recipe": '{"a": 1}'})
    update_row(db, "runs", rid, {"state": "done"})
    run = get_run(db, rid)
    assert run.state == "done" and run.recipe == {"a": 1}
    with pytest.raises(NotFound):
        get_job(db, 999)
    with pytest.raises(NotFound):
        get_run(db, 999)


def test_run_filter(tmp_path):
    db = open_db(tmp_path / "d.db")
    insert_row(db, "runs", {"name": "k26-ddtree", "model": "moonshotai/Kimi-K2.6", "created_at": 1.0})
    insert_row(db, "runs", {"name": "qwen-sweep", "model": "Qwen/Qwen3-8B", "created_at": 2.0})
    rid = insert_row(db, "runs", {"name": "demo", "created_at": 3.0})
    insert_row(db, "points", {"run_id": rid, "state": "done"})
    insert_row(db, "points", {"run_id": rid, "state": "failed"})
    assert [r.name for r in list_runs(db, text="KIMI")] == ["k26-ddtree"]
    assert [r.name for r in list_runs(db)] == ["demo", "qwen-sweep", "k26-ddtree"]
    demo = list_runs(db, text="demo")[0]
    assert (demo.points_done, demo.points_failed) == (1, 1)


HAMMER = textwrap.dedent(
    """
    import sys
    from ddtree.store import open_db, transaction
    db = open_db(sys.argv[1])
    tag = sys.argv[2]
    for i in range(int(sys.argv[3])):
        with transaction(db):
            # read-modify-write: the pattern that fails under a deferred transaction
            n = db.execute("SELECT count(*) FROM job_events").fetchone()[0]
            db.execute("INSERT INTO job_events (job_id, at, state, message) VALUES (1, ?, ?, ?)", [n, tag, str(i)])
            db.execute("UPDATE jobs SET progress_done = coalesce(progress_done, 0) + 1 WHERE id = 1")
        db["telemetry"].insert({"at": float(i), "gpu_index": 0})  # sqlite-utils' own write path
    print("ok")
    """
)


@pytest.mark.timeout(60)
def test_concurrent_writers_never_see_locked(tmp_path):
    path = tmp_path / "d.db"  # the hammers create and migrate it at once, too
    n = 300
    procs = [
        subprocess.Popen([sys.executable, "-c", HAMMER, str(path), tag, str(n)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for tag in ("a", "b", "c")
    ]
    # the job row appears while they run
    db = open_db(path)
    insert_row(db, "jobs", {"id": 1, "kind": "sleep", "state": "queued", "spec": "{}", "created_at": 0.0})
    outs = [p.communicate(timeout=60) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert out.strip() == "ok"
    assert db.execute("SELECT count(*) FROM job_events").fetchone()[0] == 3 * n
    assert db.execute("SELECT count(*) FROM telemetry").fetchone()[0] == 3 * n


LOCKS = textwrap.dedent(
    """
    import sys, subprocess
    from ddtree.store import open_db
    path = sys.argv[1]
    a = open_db(path)
    open_db(path).close()  # a second open in the same process must not drop a's locks
    # another process opens and closes: it must not see itself as the last user and drop the WAL
    subprocess.run([sys.executable, "-c", f"from ddtree.store import open_db; open_db({path!r}).close()"], check=True)
    a.execute("INSERT INTO runs (name, created_at) VALUES ('kept', 1.0)")
    a.conn.commit()
    subprocess.run([sys.executable, "-c", f"from ddtree.store import open_db; open_db({path!r}).close()"], check=True)
    print("ok")
    """
)


def test_reopening_in_one_process_keeps_committed_writes(tmp_path):
    path = tmp_path / "d.db"
    open_db(path).close()
    out = subprocess.run([sys.executable, "-c", LOCKS, str(path)], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr
    assert [r.name for r in list_runs(open_db(path))] == ["kept"]


def _newer(tmp_path, how: str):
    path = tmp_path / "ddtree.db"
    db = open_db(path)
    if how == "version":
        db.execute("PRAGMA user_version = 999")
    elif how == "migration":
        db["_sqlite_migrations"].insert({"migration_set": "ddtree-console", "name": "m099_from_the_future",
                                         "applied_at": "2030-01-01"})
    else:
        db.execute("ALTER TABLE points DROP COLUMN tau_counters")
    db.close()
    return path


@pytest.mark.parametrize("how, words", [("version", "schema version 999"), ("migration", "m099_from_the_future"),
                                         ("column", "points.tau_counters")])
def test_database_from_a_newer_version_is_refused_at_open_and_untouched(tmp_path, how, words):
    from ddtree.store.db import schema_version
    from ddtree.store.errors import NewerDatabase

    path = _newer(tmp_path, how)
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    with pytest.raises(NewerDatabase) as info:
        open_db(path)
    assert info.value.exit_code == 2 and words in info.value.message
    if how != "column":
        assert "newer ddtree-console" in info.value.message and f"knows up to {schema_version()}" in info.value.message
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before


def test_cli_on_a_newer_database_prints_one_error_line_exit_2(tmp_path, capsys):
    from ddtree.console import cli

    path = _newer(tmp_path, "version")
    assert cli.main(["--db", str(path), "runs"]) == 2
    captured = capsys.readouterr()
    lines = (captured.out + captured.err).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "newer ddtree-console" in lines[0]


def test_open_records_the_schema_version(tmp_path):
    from ddtree.store.db import schema_version

    db = open_db(tmp_path / "ddtree.db")
    assert db.execute("PRAGMA user_version").fetchone()[0] == schema_version() == len(migrations._migrations)
    db.close()


def test_open_existing_refuses_a_missing_store_and_creates_nothing(tmp_path):
    path = tmp_path / "typo" / "d.db"
    with pytest.raises(DatabasePathError, match="no store at"):
        open_existing(path)
    assert not (tmp_path / "typo").exists()
    open_db(path).close()
    with open_existing(path) as db:
        assert not migrations.pending(db)


def test_open_existing_creates_the_default_store_on_a_fresh_install(tmp_path, monkeypatch):
    monkeypatch.delenv("DDTREE_DB", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "home"))
    with open_existing() as db:
        assert not migrations.pending(db)
    assert resolve_db_path(None).is_file()
    monkeypatch.setenv("DDTREE_DB", str(tmp_path / "typo.db"))
    with pytest.raises(DatabasePathError, match="no store at"):
        open_existing()


def test_read_only_open_reads_and_writes_nothing(tmp_path):
    path = tmp_path / "d.db"
    with open_db(path) as db:
        insert_row(db, "runs", {"name": "kept", "created_at": 1.0})
    before = digest(path)
    with open_read_only(path) as db:
        assert [r.name for r in list_runs(db)] == ["kept"]
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            insert_row(db, "runs", {"name": "new", "created_at": 2.0})
    assert digest(path) == before


def test_read_only_open_refuses_a_schema_it_would_have_to_migrate(tmp_path):
    path = tmp_path / "d.db"
    open_db(path).close()
    conn = sqlite3.connect(path)
    last = migrations._migrations[-1].name
    conn.execute("DELETE FROM _sqlite_migrations WHERE name = ?", [last])
    conn.execute(f"PRAGMA user_version = {schema_version() - 1}")
    conn.commit()
    conn.close()
    before = digest(path)
    with pytest.raises(DatabasePathError, match="is read-only and its schema is older"):
        open_read_only(path)
    assert digest(path) == before
