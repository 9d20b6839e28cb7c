"""The console script run in processes forked from one interpreter that has imported the
command line once: each run is a process of its own (its exit code, its stdout and stderr,
what it leaves in /dev/shm), without a Python start and the imports of core and every
plugin per run, which is most of what a refused ``serve`` costs.

The interpreter is started with the environment of the test process and a narrow
terminal (``startup_refusals.NARROW``: what reads COLUMNS as it is imported reads 40
there), and serves one test module: the plugins installed are those of the test venv, so
runs that need other plugins on PYTHONPATH stay ``thirdparty.run_cli``."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from startup_refusals import NARROW

#: run in the warm interpreter: imports what a ``serve`` start imports, then forks a child
#: per request line (JSON: argv, environment, output files) that runs the console script's
#: ``main`` and exits with its code; answers the child's pid, then its wait status
_WARM = r"""
import importlib, json, os, sys, threading
from lmcache_tiers.cli.main import main
import lmcache_tiers.cli.serve_cmd, lmcache_tiers.server.app  # what serve imports once it runs
from lmcache_tiers.plugins import load_plugins
load_plugins()  # the plugins' modules
requests, answers = sys.stdin, sys.stdout
for line in requests:
    assert threading.active_count() == 1, threading.enumerate()  # a fork copies no thread
    request = json.loads(line)
    imported = set(sys.modules)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.environ.clear()
            os.environ.update(request["env"])
            for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
                target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.dup2(target, fd)
                os.close(target)
            stdin = os.open(os.devnull, os.O_RDONLY)  # not the requests' pipe
            os.dup2(stdin, 0)
            os.close(stdin)
            sys.argv = ["lmcache-tiers", *request["argv"]]
            main(request["argv"])
            code = 0
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else 0 if exit.code is None else 1
        except BaseException:
            import traceback
            traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            with open(request["modules"], "w") as modules:
                modules.write("\n".join(sorted(set(sys.modules) - imported)))
            os._exit(code)
    answers.write(f"{pid}\n")
    answers.flush()
    _, status = os.waitpid(pid, 0)
    # what that run imported is imported here once, not by every later run again
    with open(request["modules"]) as modules:
        for name in modules.read().split():
            try:
                importlib.import_module(name)
            except Exception:
                pass
    answers.write(f"{status}\n")
    answers.flush()
"""

#: a run that has not ended by then is killed (a ``serve`` that did not refuse serves)
RUN_TIMEOUT_S = 120.0


class ForkedCli:
    """One warm interpreter; ``run`` is ``thirdparty.run_cli`` without a site directory."""

    def __init__(self, outputs: Path) -> None:
        """``outputs``: a directory for the runs' stdout and stderr files."""
        self._warm = subprocess.Popen(
            [sys.executable, "-c", _WARM],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=dict(os.environ, **NARROW),
        )
        self._answers = b""
        self._outputs = outputs

    def run(self, args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
        assert self._warm.stdin is not None and self._warm.stdout is not None
        stdout, stderr = self._outputs / "stdout", self._outputs / "stderr"
        request = {
            "argv": args,
            "env": dict(os.environ, **env),
            "stdout": str(stdout),
            "stderr": str(stderr),
            "modules": str(self._outputs / "modules"),
        }
        self._warm.stdin.write(json.dumps(request) + "\n")
        self._warm.stdin.flush()
        pid = self._answer(RUN_TIMEOUT_S)
        assert pid is not None, f"the warm interpreter did not fork (exit code {self._warm.poll()})"
        status = self._answer(RUN_TIMEOUT_S)
        if status is None:
            os.kill(pid, signal.SIGTERM)  # a server stops on it, removing its segment
            if self._answer(30.0) is None:
                os.kill(pid, signal.SIGKILL)
                self._answer(RUN_TIMEOUT_S)  # its wait status: the next run's answers come next
            raise AssertionError(f"lmcache-tiers {' '.join(args)} did not end in {RUN_TIMEOUT_S:g}s")
        return subprocess.CompletedProcess(
            ["lmcache-tiers", *args],
            os.waitstatus_to_exitcode(status),
            stdout.read_text(),
            stderr.read_text(),
        )

    def serve_refused(self, args: list[str], **env: str) -> str:
        """``startup_refusals.serve_refused`` run here: ``serve ARGS`` with a segment name of
        its own; its one error line, having checked the exit code and that no L1 segment
        was created."""
        shm = f"tiers_preflight_{uuid.uuid4().hex[:10]}"
        result = self.run(
            ["serve", "--l1-size-gb", "0.25", "--shm-name", shm, "--metrics-port", "0", *args],
            **NARROW,
            **env,
        )
        assert result.returncode == 2, result.stdout + result.stderr
        # segments other servers killed on this machine left: removed with a line of its own
        lines = [
            line for line in result.stderr.strip().splitlines() if " lmcache_tiers.l1.stale: " not in line
        ]
        assert len(lines) == 1, result.stderr
        assert lines[0].startswith("error: "), result.stderr
        assert "Errno" not in lines[0] and "Traceback" not in result.stderr, result.stderr
        assert not os.path.exists(f"/dev/shm/{shm}")
        return lines[0]

    def _answer(self, timeout_s: float) -> int | None:
        """The next number the warm interpreter answers; None if none came in time (read
        from the descriptor itself: a buffered reader could hold both answers of a run
        while poll() waits for more)."""
        assert self._warm.stdout is not None
        deadline = time.monotonic() + timeout_s
        answers = select.poll()  # not select(): a test may hold over 1024 descriptors
        answers.register(self._warm.stdout.fileno(), select.POLLIN)
        while b"\n" not in self._answers:
            if not answers.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                return None
            more = os.read(self._warm.stdout.fileno(), 4096)
            if not more:
                return None
            self._answers += more
        line, self._answers = self._answers.split(b"\n", 1)
        return int(line)

    def close(self) -> None:
        assert self._warm.stdin is not None
        self._warm.stdin.close()  # the interpreter ends at the end of its requests
        try:
            self._warm.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._warm.kill()
            self._warm.wait()
