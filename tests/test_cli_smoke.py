import subprocess
import sys


def test_version_prints_distribution_version():
    out = subprocess.run(
        [sys.executable, "-m", "ddtree.console.cli", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.startswith("ddtree-console 0.1.0")
