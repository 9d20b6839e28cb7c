"""Install one plugin next to core and run its tests: what each tox ``plugin-<dir>`` env does.

Usage: ``python scripts/plugin_env.py plugin-<dir> [pytest args]`` (``--plan`` prints the
commands instead of running them).  The plugin is installed with its ``test`` extras;
requirements on other ``lmcache-plugin-*`` distributions are installed from their
directories under ``plugins/`` first (they are not on any index).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "plugin-"


def local_plugins(directory: Path) -> list[Path]:
    """Directories of the ``lmcache-plugin-*`` distributions a plugin (or its tests) needs."""
    project = tomllib.loads((directory / "pyproject.toml").read_text())["project"]
    wanted = [*project.get("dependencies", []), *project.get("optional-dependencies", {}).get("test", [])]
    names = {m.group(1) for r in wanted if (m := re.match(r"lmcache-plugin-([a-z0-9-]+)", r))}
    return [ROOT / "plugins" / name for name in sorted(names)]


def plan(env_name: str, pytest_args: list[str]) -> list[list[str]]:
    if not env_name.startswith(PREFIX):
        raise SystemExit(f"{env_name!r} is not a plugin env (plugin-<directory>)")
    directory = ROOT / "plugins" / env_name.removeprefix(PREFIX)
    if not (directory / "pyproject.toml").is_file():
        raise SystemExit(f"no plugin directory {directory}")
    pip = [sys.executable, "-m", "pip", "install", "-q", "-c", str(ROOT / "constraints.txt")]
    editable = [arg for needed in local_plugins(directory) for arg in ("-e", str(needed))]
    return [
        [*pip, *editable, "-e", f"{directory}[test]"],
        [sys.executable, "-m", "pytest", str(directory), *pytest_args],
    ]


def main(argv: list[str]) -> int:
    show = "--plan" in argv
    args = [arg for arg in argv if arg != "--plan"]
    if not args:
        raise SystemExit(__doc__)
    commands = plan(args[0], args[1:])
    if show:
        for command in commands:
            print(" ".join(command))
        return 0
    for command in commands:
        subprocess.run(command, check=True, cwd=ROOT)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
