"""The real entry point: dry run output, one-line errors with exit 2, never a traceback."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def cli(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "ddtree.console.cli", "--db", str(tmp_path / "d.db"), *args],
                          capture_output=True, text=True, timeout=60)


def test_dry_run_json_of_the_demo_recipe_starts_nothing(tmp_path):
    out = cli(tmp_path, "sweep", str(ROOT / "assets" / "recipes" / "demo.toml"), "--dry-run", "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert len(plan["launches"]) == 1 and len(plan["points"]) == 8
    assert plan["launches"][0]["argv"][-2:] == ["--port", "0"]
    assert not (tmp_path / "d.db").exists()


def test_bad_input_is_one_line_with_exit_2(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\n[engine]\nalgorithm = "ar"\n[sweep]\nbudget = [4]\n')
    for args in (("sweep", str(bad)), ("sweep", str(tmp_path / "missing.toml")), ("export", "7", "--format", "md"),
                 ("sweep",), ("export", "x")):
        out = cli(tmp_path, *args)
        assert out.returncode == 2, (args, out.stderr)
        assert "Traceback" not in out.stderr
        assert out.stderr.strip().splitlines()[-1].startswith(("error:", "ddtree-console")), out.stderr
