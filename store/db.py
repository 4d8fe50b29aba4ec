"""Opening the database: where it lives, permissions, WAL, busy timeout, migrations.

Every process (the console, each runner, the CLI) opens its own connection with `open_db`.
WAL lets readers run beside the one writer; the busy timeout makes a second writer wait instead
of failing. Writes that read before they write must use `transaction(db)` (BEGIN IMMEDIATE):
a deferred transaction that reads first cannot wait for the lock, SQLite fails it at once.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path

from sqlite_utils import Database

from ddtree.store.errors import (
    CorruptDatabase,
    DatabasePathError,
    ForeignDatabase,
    NewerDatabase,
    StoreError,
)
from ddtree.store.migrations import APPLICATION_ID, MIGRATION_SET, migrations

#: Seconds a writer waits for another writer before SQLite gives up.
BUSY_TIMEOUT_S = 60.0


def default_db_path() -> Path:
    """$DDTREE_DB, else $XDG_DATA_HOME/ddtree-console/ddtree.db (XDG default ~/.local/share)."""
    env = os.environ.get("DDTREE_DB")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(xdg).expanduser() / "ddtree-console" / "ddtree.db"


def resolve_db_path(path: str | os.PathLike | None = None) -> Path:
    """The absolute path `open_db(path)` would open."""
    return (Path(path).expanduser() if path is not None else default_db_path()).absolute()


def data_dir(db_path: str | os.PathLike | None = None) -> Path:
    """The folder that holds the database; logs go to data_dir/logs."""
    return resolve_db_path(db_path).parent


def db_file(db: Database) -> str:
    """The file an open connection is on (where its logs folder belongs)."""
    return db.execute("PRAGMA database_list").fetchone()[2]


def data_version(db: Database) -> int:
    """SQLite's counter that moves only when another connection commits: one cheap read tells a
    poller whether anything is new."""
    return db.execute("PRAGMA data_version").fetchone()[0]


def logs_dir(db_path: str | os.PathLike | None = None) -> Path:
    """data_dir/logs, created owner-only if missing."""
    folder = data_dir(db_path) / "logs"
    _make_private_dir(folder)
    # Checked on every start, not only when made: a folder from an older version, or one loosened
    # since (chmod, a copy), would show every job's log to the other users of the machine.
    mode = folder.stat().st_mode & 0o777
    if mode != 0o700:
        try:
            folder.chmod(0o700)
        except OSError as exc:
            raise DatabasePathError(f"logs folder {folder} is mode {mode:o} and cannot be made 0700: {exc.strerror}",
                                    f"chmod 700 {folder}") from None
    return folder


def _make_private_dir(folder: Path) -> None:
    if folder.is_dir():
        return
    if folder.exists():
        raise DatabasePathError(f"{folder} exists and is not a folder", "choose another path with --db or DDTREE_DB")
    try:
        folder.mkdir(parents=True, mode=0o700)
        # mkdir's mode is filtered by the umask; the leaf is ours to lock down.
        folder.chmod(0o700)
    except FileExistsError:
        return
    except OSError as exc:
        raise DatabasePathError(
            f"cannot create folder {folder}: {exc.strerror}", "choose a writable path with --db or DDTREE_DB"
        ) from None


def _create_private_file(path: Path) -> None:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return
    except OSError as exc:
        raise DatabasePathError(
            f"cannot create {path}: {exc.strerror}", "choose a writable path with --db or DDTREE_DB"
        ) from None
    os.close(fd)


def _check_ours(db: Database, path: Path) -> None:
    app_id = db.execute("PRAGMA application_id").fetchone()[0]
    if app_id == APPLICATION_ID:
        return
    names = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()]
    if not names:
        return
    ours = False
    if "_sqlite_migrations" in names:
        ours = bool(
            db.execute("SELECT 1 FROM _sqlite_migrations WHERE migration_set = ?", [MIGRATION_SET]).fetchone()
        )
    if not ours:
        raise ForeignDatabase(
            f"{path} is a SQLite database of another application (tables: {', '.join(sorted(names)[:5])})",
            "it was left untouched; pass another path with --db or DDTREE_DB",
        )


def connect(path: Path, uri_query: str | None = None) -> Database:
    """A connection with our pragmas, no checks, no migrations (used by `open_db`). `uri_query`
    opens the file as a URI with those parameters ("mode=ro")."""
    target, uri = (f"{path.absolute().as_uri()}?{uri_query}", True) if uri_query else (str(path), False)
    conn = sqlite3.connect(target, timeout=BUSY_TIMEOUT_S, check_same_thread=False, uri=uri)
    try:
        db = Database(conn)
        db.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        db.execute("PRAGMA synchronous = NORMAL")
        db.execute("PRAGMA foreign_keys = ON")
    except BaseException:
        conn.close()  # the caller never gets it to close, and its descriptor would pin the file
        raise
    return db


def open_db(path: str | os.PathLike | None = None) -> Database:
    """Open (creating if needed) the store and bring its schema up to date.

    None -> `default_db_path()`. The folder is created 0700, the file 0600. A file that is not
    SQLite, is damaged, or belongs to another application raises StoreError and stays untouched.
    The connection may be handed to another thread, but use it from one thread at a time.
    """
    db_path = resolve_db_path(path)
    if db_path.is_dir():
        raise DatabasePathError(f"{db_path} is a folder", "pass the path of a database file with --db or DDTREE_DB")
    _make_private_dir(db_path.parent)
    # Never read the file ourselves to sniff it: closing any descriptor of a database file drops
    # every POSIX lock this process holds on it, including those of open SQLite connections, and
    # another process may then checkpoint and delete the WAL under them (committed writes vanish).
    # SQLite reports a file that is not a database on the first query, without writing to it.
    if not db_path.exists():
        _create_private_file(db_path)
    db = None
    try:
        db = connect(db_path)
        _check_ours(db, db_path)
        _check_not_newer(db, db_path)
        if db.journal_mode != "wal":
            db.enable_wal()
        _migrate(db)
        _check_columns(db, db_path)
    except (sqlite3.DatabaseError, StoreError) as exc:
        raise _discard(db, exc, db_path) from None
    return db


def _discard(db: Database | None, exc: Exception, db_path: Path) -> Exception:
    """What a failed open raises, with its connection (if it got one) closed: a SQLite error
    classified, a StoreError as it is."""
    if db is not None:
        db.close()
    return _classify(exc, db_path) if isinstance(exc, sqlite3.DatabaseError) else exc


def open_existing(path: str | os.PathLike | None = None) -> Database:
    """Open the store for a command that only reads it (runs, jobs, export).

    Unlike `open_db`, a path given with no store there is refused: a typo in --db or DDTREE_DB
    must not be answered from a new, empty store left behind. The default path is created, as
    `open_db` does, so a fresh install lists no runs rather than an error. Where the file or its
    folder cannot be written (read-only storage) it is opened read-only, which needs its schema to
    be current already.
    """
    db_path = existing_store(path)
    if not db_path.exists():
        return open_db(db_path)  # the default store on a fresh install: no runs yet, not a typo
    return open_db(db_path) if writable(db_path) else open_read_only(db_path)


def existing_store(path: str | os.PathLike | None = None) -> Path:
    """The store's path for a command that needs what is in it (reads, cancel, resume, settle): a
    --db or DDTREE_DB path with no store there is refused, since a typo must not leave a new,
    empty store behind. The default path may be missing (a fresh install)."""
    db_path = resolve_db_path(path)
    if db_path.is_dir():
        raise DatabasePathError(f"{db_path} is a folder", "pass the path of a database file with --db or DDTREE_DB")
    if not db_path.exists() and (path is not None or os.environ.get("DDTREE_DB")):
        raise DatabasePathError(f"no store at {db_path}",
                                "check --db and DDTREE_DB; a sweep, a download or `jobs submit` creates it")
    return db_path


def open_read_only(db_path: Path) -> Database:
    """Open an existing store without writing to it: no WAL switch, no migrations, so its schema
    must be current already (else DatabasePathError)."""
    db = None
    try:
        try:
            db = connect(db_path, "mode=ro")
            db.execute("SELECT count(*) FROM sqlite_master").fetchone()
        except sqlite3.OperationalError as exc:
            # A WAL store needs its -shm file, which read-only storage neither has nor lets us
            # make. Immutable reads the main file alone, so only where no -wal holds changes not
            # yet written back into it (else they would silently be missing).
            if db is not None:
                db.close()
            wal = db_path.with_name(db_path.name + "-wal")
            if "unable to open" not in str(exc):
                raise
            if wal.exists() and wal.stat().st_size > 0:
                raise DatabasePathError(
                    f"{db_path} is read-only and has changes not yet written back into it (its -wal file)",
                    "open it once where it can be written, or copy it with its -wal file to writable storage",
                ) from None
            db = connect(db_path, "immutable=1")
        _check_ours(db, db_path)
        _check_not_newer(db, db_path)
        if migrations.pending(db) or db.execute("PRAGMA user_version").fetchone()[0] != schema_version():
            raise DatabasePathError(
                f"{db_path} is read-only and its schema is older than this ddtree-console's",
                "open it once where it can be written, to upgrade it, or pass another path with --db",
            )
        _check_columns(db, db_path)
    except (sqlite3.DatabaseError, StoreError) as exc:
        raise _discard(db, exc, db_path) from None
    return db


def writable(path: str | os.PathLike | None = None) -> bool:
    """Whether the store file and its folder (where SQLite keeps its -wal and -shm) can be written."""
    db_path = resolve_db_path(path)
    return os.access(db_path, os.W_OK) and os.access(db_path.parent, os.W_OK)


def schema_version() -> int:
    """The schema this version writes: the number of migrations it knows. `open_db` stores it in
    `PRAGMA user_version`, so an older ddtree-console can tell a database is past it."""
    return len(_known_migrations())


def _known_migrations() -> list[str]:
    return [m.name for m in migrations._migrations]  # sqlite_utils keeps the registered list there


def _check_not_newer(db: Database, path: Path) -> None:
    """Refuse, before anything is written, a database a newer ddtree-console has migrated: running
    on it would fail later, half way (a sweep after its engine started: "no such column")."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    known = _known_migrations()
    unknown = [m.name for m in migrations.applied(db) if m.name not in known]
    if version <= len(known) and not unknown:
        return
    what = f"schema version {version}" if version > len(known) else f"migration {unknown[0]}"
    raise NewerDatabase(
        f"{path} was written by a newer ddtree-console ({what}; this one knows up to {len(known)})",
        "upgrade ddtree-console, or pass another database with --db or DDTREE_DB; it was left untouched",
    )


@functools.lru_cache(maxsize=1)
def _expected_columns() -> dict[str, frozenset[str]]:
    """table -> columns, from the migrations run on an empty in-memory database (once a process)."""
    ref = Database(sqlite3.connect(":memory:"))
    try:
        migrations.apply(ref)
        tables = [r[0] for r in ref.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()]
        return {t: frozenset(c.name for c in ref[t].columns) for t in tables if not t.startswith("sqlite_")}
    finally:
        ref.close()


def _check_columns(db: Database, path: Path) -> None:
    """Every column the migrations made is there (a schema altered by hand or by another build of
    the same migration names would otherwise fail mid-job)."""
    for table, expected in sorted(_expected_columns().items()):
        have = {c.name for c in db[table].columns}
        missing = sorted(expected - have)
        if missing:
            raise NewerDatabase(
                f"{path} lacks column {table}.{missing[0]} that schema version {schema_version()} has: "
                "it was written by another ddtree-console version or changed by hand",
                "pass another database with --db or DDTREE_DB; it was left as it is",
            )


def _migrate(db: Database) -> None:
    version = schema_version()
    # Cheap read first: the common case is "nothing to do" and needs no write lock.
    if (migrations.applied(db) and not migrations.pending(db)
            and db.execute("PRAGMA user_version").fetchone()[0] == version):
        return
    # BEGIN IMMEDIATE serialises two processes migrating a new file at once; the second one
    # waits, then finds nothing pending. Migrations.apply nests as savepoints inside it.
    with transaction(db):
        migrations.apply(db)
        if db.execute("PRAGMA user_version").fetchone()[0] < version:
            db.execute(f"PRAGMA user_version = {version}")


def _classify(exc: sqlite3.DatabaseError, path: Path) -> StoreError:
    text = str(exc)
    if isinstance(exc, sqlite3.OperationalError) and (
        "unable to open" in text or "readonly" in text or "read-only" in text or "disk I/O" in text
    ):
        return DatabasePathError(
            f"cannot write {path}: {text}", "the database and its folder must be writable; use --db or DDTREE_DB"
        )
    if "not a database" in text:
        return CorruptDatabase(
            f"{path} is not a SQLite database",
            "it was left untouched; move it away or pass another path with --db or DDTREE_DB",
        )
    if "malformed" in text or "corrupt" in text:
        return CorruptDatabase(
            f"{path} is damaged: {text}",
            "it was left untouched; move it away or pass another path with --db or DDTREE_DB",
        )
    return StoreError(f"cannot open {path}: {text}")


@contextlib.contextmanager
def transaction(db: Database) -> Iterator[Database]:
    """A write transaction that takes the write lock up front (BEGIN IMMEDIATE).

    Use it for any read-modify-write, so a concurrent writer makes it wait (busy timeout)
    instead of failing with "database is locked". Nested use becomes a savepoint.
    """
    if db.conn.in_transaction:
        with db.atomic():
            yield db
        return
    db.conn.execute("BEGIN IMMEDIATE")
    try:
        yield db
    except BaseException:
        if db.conn.in_transaction:
            db.conn.execute("ROLLBACK")
        raise
    else:
        db.conn.execute("COMMIT")
