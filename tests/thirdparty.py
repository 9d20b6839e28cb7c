"""Build throwaway third-party plugin packages and run the CLI against them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

CLI = [sys.executable, "-m", "lmcache_tiers.cli.main"]


def write_package(root: Path, dist: str, module: str, source: str) -> Path:
    """A minimal distribution with one entry point in the ``lmcache_tiers`` group."""
    package = root / dist
    (package / module).mkdir(parents=True)
    (package / "pyproject.toml").write_text(
        textwrap.dedent(
            f"""
            [build-system]
            requires = ["setuptools>=61"]
            build-backend = "setuptools.build_meta"

            [project]
            name = "{dist}"
            version = "1.2.3"

            [project.entry-points.lmcache_tiers]
            {dist} = "{module}"

            [tool.setuptools]
            packages = ["{module}"]
            """
        )
    )
    (package / module / "__init__.py").write_text(textwrap.dedent(source))
    return package


def pip_install_to(target: Path, package: Path) -> None:
    """Install like a user would (pip, real metadata and entry points), into ``target``."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(package),
        ],
        check=True,
        capture_output=True,
    )


def run_cli(args: list[str], site: Path | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    environ = dict(os.environ, **env)
    if site is not None:
        environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), environ.get("PYTHONPATH", "")]))
    return subprocess.run(CLI + args, capture_output=True, text=True, env=environ, timeout=120)
