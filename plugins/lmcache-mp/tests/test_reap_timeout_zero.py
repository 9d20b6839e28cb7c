"""LMCache's ``--worker-reap-timeout-seconds 0`` turns its reaper off; ``worker_reap_timeout_s``
refuses 0.  Instance ids are the clients' choice and at most 1024 instances are registered
at once (handlers.MAX_INSTANCES): with no reaper, every client that vanished without
unregistering would keep its place until the table refused every new registration.  An
operator carrying the LMCache value over is told so by docs/lmcache-compat.md and the
front end's page, which otherwise say the option is what LMCache's flag sets.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from lmcache_plugin_lmcache_mp.handlers import MAX_INSTANCES

from lmcache_tiers.config import build_config
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.plugins import load_registry

DOCS = Path(__file__).resolve().parents[3] / "docs"


def _one_line(path: Path, pattern: str) -> str:
    lines: list[str] = re.findall(pattern, path.read_text(), flags=re.MULTILINE)
    (line,) = lines
    return line


def test_a_reap_timeout_of_zero_is_refused() -> None:
    frontend = {"type": "lmcache_mp", "worker_reap_timeout_s": 0}
    with pytest.raises(ConfigError, match="worker_reap_timeout_s"):
        build_config(load_registry(), frontend_json=[json.dumps(frontend)])


def test_the_docs_say_lmcaches_zero_is_refused_and_why() -> None:
    row = _one_line(DOCS / "lmcache-compat.md", r"^\| `--worker-reap-timeout-seconds` \|.*$")
    assert "`0`" in row and "refused" in row and f"{MAX_INSTANCES} instances" in row
    option = _one_line(DOCS / "frontends" / "lmcache-mp.md", r"^\| `worker_reap_timeout_s` \|.*$")
    assert "`0`" in option and "refused" in option
