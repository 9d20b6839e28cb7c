"""Every Python log line of a server process has the server's format, whoever logs it."""

from __future__ import annotations

import re
import subprocess
import sys

# What configure_logging() prints: "<date> <time>,<ms> <LEVEL> <logger>: <message>"
LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR) [\w.]+: .+$")

EMIT = """
import logging
from lmcache_tiers.server.logs import configure_logging
configure_logging()
logging.getLogger("lmcache_plugin_nixl.dynamic").warning("record 1 failed its checksum; deleted")
logging.getLogger("lmcache_plugin_mock.adapter").info("plugin info line")
logging.getLogger("lmcache_tiers.server.app").info("core info line")
logging.getLogger("lmcache_plugin_mock.adapter").debug("plugin debug line")
logging.getLogger("some_library").info("library info line")
logging.getLogger("some_library").warning("library warning line")
"""


def _emit(level: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", EMIT],
        capture_output=True,
        text=True,
        env={"LMCACHE_LOG_LEVEL": level, "PATH": "/usr/bin:/bin"},
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    return done.stderr.splitlines()


def test_plugin_core_and_library_lines_share_the_format() -> None:
    lines = _emit("INFO")
    assert len(lines) == 4, lines
    for line in lines:
        assert LINE.match(line), line
    assert lines[0].endswith("WARNING lmcache_plugin_nixl.dynamic: record 1 failed its checksum; deleted")
    assert lines[1].endswith("INFO lmcache_plugin_mock.adapter: plugin info line")
    assert lines[2].endswith("INFO lmcache_tiers.server.app: core info line")
    # other libraries keep WARNING, whatever LMCACHE_LOG_LEVEL says
    assert lines[3].endswith("WARNING some_library: library warning line")


def test_log_level_applies_to_plugin_packages() -> None:
    debug = _emit("DEBUG")
    assert any(line.endswith("DEBUG lmcache_plugin_mock.adapter: plugin debug line") for line in debug)
    assert not any("library info line" in line for line in debug)
    quiet = _emit("WARNING")
    assert [line.rsplit(": ", 1)[1] for line in quiet] == [
        "record 1 failed its checksum; deleted",
        "library warning line",
    ]
