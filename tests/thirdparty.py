"""Build throwaway third-party plugin packages and run the CLI (and a server) against them."""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

sys.path.insert(0, str(Path(__file__).parent / "server"))

from tiers_e2e import ServerProcess, stop_signals_at_default

from lmcache_tiers.testing.ports import free_port as free_port  # re-exported for the tests

CLI = [sys.executable, "-m", "lmcache_tiers.cli.main"]
START_TIMEOUT_S = 60.0


def write_package(
    root: Path, dist: str, module: str, source: str, submodules: dict[str, str] | None = None
) -> Path:
    """A minimal distribution with one entry point in the ``lmcache_tiers`` group;
    ``submodules`` adds ``<module>/<name>.py`` files."""
    package = root / dist
    (package / module).mkdir(parents=True)
    (package / "pyproject.toml").write_text(
        textwrap.dedent(
            f"""
            [build-system]
            requires = ["setuptools>=77"]
            build-backend = "setuptools.build_meta"

            [project]
            name = "{dist}"
            version = "1.2.3"
            license = "Apache-2.0"

            [project.entry-points.lmcache_tiers]
            {dist} = "{module}"

            [tool.setuptools]
            packages = ["{module}"]
            """
        )
    )
    (package / module / "__init__.py").write_text(textwrap.dedent(source))
    for name, text in (submodules or {}).items():
        (package / module / f"{name}.py").write_text(textwrap.dedent(text))
    return package


def install_flat_plugin(site: Path, name: str, module: str, source: str) -> None:
    """Into ``site`` (a directory put on PYTHONPATH), without pip: a distribution
    ``tiers-<name>`` whose entry point ``name`` is the one-file module ``module``."""
    dist = site / f"tiers_{name}-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: tiers-{name}\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[lmcache_tiers]\n{name} = {module}\n")
    (site / f"{module}.py").write_text(source)


def pip_install_to(target: Path, *packages: Path) -> None:
    """Install like a user would (pip, real metadata and entry points), into ``target``;
    several packages in one pip run (each run costs pip's start-up)."""
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
            *(str(package) for package in packages),
        ],
        check=True,
        capture_output=True,
    )


def _environment(site: Path | None, env: dict[str, str]) -> dict[str, str]:
    environ = dict(os.environ, **env)
    if site is not None:
        environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), environ.get("PYTHONPATH", "")]))
    return environ


def run_cli(args: list[str], site: Path | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        CLI + args, capture_output=True, text=True, env=_environment(site, env), timeout=120
    )


@functools.cache
def _command() -> Any:
    from lmcache_tiers.cli.main import build_app, command_tree

    return command_tree(build_app())


def run_cli_in_process(args: list[str]) -> subprocess.CompletedProcess[str]:
    """``run_cli`` in this process, as the console script runs it (``cli.main.run`` on a
    command built once), for the plugins installed here: a fraction of a second a call
    instead of a Python start and the plugin imports.  For checks of exit codes and output
    only; what the process itself does (signals, files left, its environment) needs
    ``run_cli``.  What the command sets for its process (serve sets LMCACHE_LOG_LEVEL and
    the levels of core's and the plugins' loggers) is undone, so that it reaches neither
    later tests nor their servers."""
    from lmcache_tiers.cli.main import run

    out, err = io.StringIO(), io.StringIO()
    code: object = 0
    environment, levels, handlers = dict(os.environ), _logger_levels(), list(logging.root.handlers)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            run(_command, args)
        except SystemExit as exc:
            code = exc.code
        finally:
            _restore_environment(environment)
            _restore_logging(levels, handlers)
    returncode = code if isinstance(code, int) else 0 if code is None else 1
    return subprocess.CompletedProcess(CLI + args, returncode, out.getvalue(), err.getvalue())


def _restore_environment(saved: dict[str, str]) -> None:
    """Make ``os.environ`` what it was (only the variables that changed are touched)."""
    for name in set(os.environ) - set(saved):
        del os.environ[name]
    for name, value in saved.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


def _logger_levels() -> dict[str, int]:
    loggers = logging.root.manager.loggerDict.items()
    return {name: found.level for name, found in loggers if isinstance(found, logging.Logger)}


def _restore_logging(levels: dict[str, int], handlers: list[logging.Handler]) -> None:
    """Give every logger its level from before (NOTSET to one made since) and the root
    logger its handlers (one added would write to the output captured for one call)."""
    for name, found in logging.root.manager.loggerDict.items():
        if isinstance(found, logging.Logger):
            found.setLevel(levels.get(name, logging.NOTSET))
    logging.root.handlers[:] = handlers


def launch_cli(args: list[str], site: Path | None = None, **env: str) -> subprocess.Popen[str]:
    """``run_cli`` without waiting: stdout and stderr are pipes for ``communicate``."""
    return subprocess.Popen(
        CLI + args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_environment(site, env),
        preexec_fn=stop_signals_at_default(),
    )


def launch_script(script: str, *argv: str) -> subprocess.Popen[str]:
    """``python -c script *argv``, its stop signals at their default action; stdout and
    stderr are pipes for ``communicate``."""
    return subprocess.Popen(
        [sys.executable, "-c", script, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=stop_signals_at_default(),
    )


def wait_for(server: ServerProcess, condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Poll ``condition`` until it holds; fail with the server's output after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not done within {timeout:g}s\n{server.output()}")
        time.sleep(0.05)


def launch_serve(
    args: list[str], site: Path | None, log_dir: Path, *, port: int | None = None, **env: str
) -> ServerProcess:
    """Start ``lmcache-tiers serve ARGS`` on loopback ``port`` (a free one by default), no
    HTTP endpoint, a segment of its own; not waited for."""
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port() if port is None else port
    shm_name = f"tiers_cli_{uuid.uuid4().hex[:12]}"
    command = [
        *CLI,
        "serve",
        "--port",
        str(port),
        "--metrics-port",
        "0",
        "--shm-name",
        shm_name,
        *args,
    ]
    proc = subprocess.Popen(
        command,
        stdout=(log_dir / "stdout.txt").open("wb"),
        stderr=(log_dir / "stderr.txt").open("wb"),
        env=_environment(site, {"COLUMNS": "200", **env}),
        preexec_fn=stop_signals_at_default(),
    )
    return ServerProcess(f"tcp://127.0.0.1:{port}", None, shm_name, proc, log_dir)


def launch_l1_only_serve(
    log: IO[str],
    *,
    shm_name: str,
    port: int,
    metrics_port: int = 0,
    preexec_fn: Callable[[], None] | None = None,
    **env: str,
) -> subprocess.Popen[bytes]:
    """Start ``lmcache-tiers serve`` with a 0.25 GB L1 and no L2 on loopback ``port``, both
    output streams to ``log``; ``preexec_fn`` runs in the child before serve (the stop
    signals at their defaults when not given).  Not waited for."""
    command = [
        *CLI,
        "serve",
        "--no-default-l2",
        "--l1-size-gb",
        "0.25",
        "--shm-name",
        shm_name,
        "--port",
        str(port),
        "--metrics-port",
        str(metrics_port),
    ]
    return subprocess.Popen(
        command,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=_environment(None, env),
        preexec_fn=preexec_fn or stop_signals_at_default(),
    )


def serve_cli(args: list[str], site: Path | None, log_dir: Path, **env: str) -> ServerProcess:
    """``launch_serve``, then wait until the server answers PING."""
    from lmcache_tiers.client import Client, ClientError

    served = launch_serve(args, site, log_dir, **env)
    proc = served.proc
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"serve exited with {proc.returncode} during start-up\n{served.output()}")
        try:
            with Client(served.url, timeout=0.5) as client:
                client.ping()
            return served
        except ClientError:
            if time.monotonic() > deadline:
                served.stop(signal.SIGKILL)
                raise AssertionError(
                    f"serve did not answer within {START_TIMEOUT_S:g}s\n{served.output()}"
                ) from None
            time.sleep(0.1)
