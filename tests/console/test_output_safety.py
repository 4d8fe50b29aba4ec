"""Where the CLI writes and what it prints: export -o onto special files, log modes, escapes."""

import os
import stat
import threading

import pytest

from ddtree.console import cli, fmt
from ddtree.console.files import OutputError, write_output

pytestmark = pytest.mark.timeout(60)


# -- export -o ---------------------------------------------------------------------------------

def test_a_regular_file_is_replaced_atomically_and_keeps_its_mode(tmp_path):
    path = tmp_path / "out.csv"
    path.write_text("old")
    path.chmod(0o640)
    write_output(path, "new\n")
    assert path.read_text() == "new\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.csv"]  # no temp file left


def test_a_missing_path_is_created(tmp_path):
    write_output(tmp_path / "new.md", "x")
    assert (tmp_path / "new.md").read_text() == "x"
    with pytest.raises(OutputError, match="does not exist"):
        write_output(tmp_path / "nope" / "x.md", "x")
    write_output(tmp_path / "made" / "x.md", "y", make_parents=True)
    assert (tmp_path / "made" / "x.md").read_text() == "y"


def test_a_symlink_is_followed_and_stays_a_link(tmp_path):
    target = tmp_path / "real.csv"
    target.write_text("old")
    link = tmp_path / "link.csv"
    link.symlink_to(target)
    write_output(link, "new")
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text() == "new"


def test_a_character_device_is_written_into_not_replaced(tmp_path):
    before = os.stat("/dev/null")
    write_output("/dev/null", "anything")
    after = os.stat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and after.st_ino == before.st_ino
    # Through a link to the device too.
    (tmp_path / "null").symlink_to("/dev/null")
    write_output(tmp_path / "null", "x")
    assert (tmp_path / "null").is_symlink() and stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_a_fifo_is_written_into(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo).read()))
    reader.start()
    write_output(fifo, "through the pipe\n")
    reader.join(10)
    assert got == ["through the pipe\n"]
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_a_folder_is_refused(tmp_path):
    with pytest.raises(OutputError, match="is a folder"):
        write_output(tmp_path, "x")


def test_the_console_export_uses_the_same_writer(tmp_path):
    from ddtree.console import export

    assert "write_output" in export.export_run.__code__.co_names


# -- ids too large for SQLite, devices the server does not know ---------------------------------

@pytest.mark.parametrize("argv", [
    ["export", "1180591620717411303424"],
    ["jobs", "show", "1180591620717411303424"],
    ["jobs", "logs", "1180591620717411303424"],
    ["jobs", "cancel", "1180591620717411303424"],
    ["sweep", "--resume", "1180591620717411303424"],
    ["serve", "--device", "tpu"],
    ["serve", "--device", "cuda:x"],
])
def test_out_of_range_arguments_are_one_line_exit_2(tmp_path, capsys, argv):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--db", str(tmp_path / "d.db"), *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err


# -- log files and their folder ----------------------------------------------------------------

def test_logs_are_0600_and_the_folder_0700_whatever_the_umask(tmp_path):
    from ddtree.jobs.context import JobContext
    from ddtree.jobs.model import create_job
    from ddtree.store import logs_dir, open_db

    db_path = tmp_path / "d.db"
    old = os.umask(0)
    try:
        with open_db(db_path) as db:
            job = create_job(db, "sleep", {"seconds": 0.0, "fail": False, "message": ""})
        folder = logs_dir(db_path)
        folder.chmod(0o755)  # loosened since it was made
        ctx = JobContext(job, db_path)
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        ctx.log("hello")
        child = ctx.spawn(["true"], name="child")
        child.wait()
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()}
    assert modes == {f"job-{job}.log": 0o600, f"job-{job}-child.log": 0o600}


# -- terminal escapes --------------------------------------------------------------------------

HOSTILE = "evil\x1b[2J\x1b]0;pwned\x07\u202eexe.txt\x9b"


def test_printable_escapes_controls_and_bidi():
    out = fmt.printable(HOSTILE)
    assert out == "evil\\x1b[2J\\x1b]0;pwned\\x07\\u202eexe.txt\\x9b"
    assert fmt.printable("plain ünïcode → ok") == "plain ünïcode → ok"


def test_runs_and_jobs_print_stored_names_escaped(tmp_path, capsys):
    from ddtree.jobs.model import create_job
    from ddtree.store import open_db, sweeps

    db_path = str(tmp_path / "d.db")
    with open_db(db_path) as db:
        sweeps.create_run(db, job_id=None, name=HOSTILE, recipe={"name": HOSTILE}, engine_kind="builtin",
                          points_total=1)
        job = create_job(db, "sleep", {"seconds": 0.0, "fail": False, "message": ""}, name=HOSTILE)
    for argv in (["runs"], ["jobs"], ["jobs", "show", str(job)]):
        assert cli.main(["--db", db_path, *argv]) == 0
        out = capsys.readouterr().out
        assert "\x1b" not in out and "\u202e" not in out and "\x9b" not in out and "\x07" not in out, argv
        assert "evil\\x1b" in out


def test_console_table_cells_are_escaped():
    from rich.text import Text

    from ddtree.console.widgets.rowtable import _printable

    assert _printable(HOSTILE) == fmt.printable(HOSTILE)
    cell = _printable(Text(HOSTILE, style="red"))  # rich drops BEL itself, but keeps ESC and U+202E
    assert cell.plain == fmt.printable(Text(HOSTILE).plain) and str(cell.style) == "red"
    assert "\x1b" not in cell.plain and "\u202e" not in cell.plain
    same = Text("fine")
    assert _printable(same) is same


def test_export_command_follows_a_symlink_and_writes_into_a_fifo(tmp_path, capsys):
    from ddtree.store import open_db, sweeps

    db_path = str(tmp_path / "d.db")
    with open_db(db_path) as db:
        run = sweeps.create_run(db, job_id=None, name="r", recipe={"name": "r"}, engine_kind="builtin", points_total=0)
    target = tmp_path / "real.csv"
    target.write_text("old")
    (tmp_path / "link.csv").symlink_to(target)
    assert cli.main(["--db", db_path, "export", str(run), "-o", str(tmp_path / "link.csv")]) == 0
    assert (tmp_path / "link.csv").is_symlink() and target.read_text().startswith("id,")
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo).read()))
    reader.start()
    assert cli.main(["--db", db_path, "export", str(run), "-o", str(fifo)]) == 0
    reader.join(10)
    assert got and got[0].startswith("id,") and stat.S_ISFIFO(os.stat(fifo).st_mode)
