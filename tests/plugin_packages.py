"""Installing a plugin package like a user would (into a target directory put on
PYTHONPATH, never into the test venv) and running its own tests in a subprocess."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from thirdparty import pip_install_to


def environment(site: Path) -> dict[str, str]:
    return dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    )


def run_tests(package: Path, site: Path) -> subprocess.CompletedProcess[str]:
    """The package's own test suite, run by pytest in a subprocess from its directory."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--import-mode=importlib",
            "--rootdir",
            str(package),
            str(package / "tests"),
        ],
        capture_output=True,
        text=True,
        env=environment(site),
        timeout=300,
        cwd=package,
    )


def install_and_test(source: Path, copy: Path, site: Path) -> None:
    """Copy ``source``, install the copy into ``site`` and assert its tests pass."""
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns("*.egg-info", "__pycache__", "build"))
    pip_install_to(site, copy)
    result = run_tests(copy, site)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " failed" not in result.stdout
