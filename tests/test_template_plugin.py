"""The copy-me skeleton installs as a plugin and passes its own conformance tests."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from thirdparty import pip_install_to, run_cli

TEMPLATE = Path(__file__).resolve().parents[1] / "plugins" / "_template"


def test_template_installs_lists_and_passes_its_suite(tmp_path: Path) -> None:
    copy = tmp_path / "template"
    shutil.copytree(TEMPLATE, copy, ignore=shutil.ignore_patterns("*.egg-info", "__pycache__", "build"))
    site = tmp_path / "site"
    pip_install_to(site, copy)
    listed = run_cli(["plugins", "list", "--json"], site)
    assert '"l2_adapter:template_memory"' in listed.stdout
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--import-mode=importlib",
            "--rootdir",
            str(copy),
            str(copy / "tests"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=copy,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " failed" not in result.stdout
