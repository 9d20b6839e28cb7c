"""A ``frontend_pool_max_mb`` under the largest request the ``lmcache_mp`` front end reads
(a pickled ``commit_store`` of up to ``max_message_mb``) is refused at start-up, in one
line naming both options, exit code 2: such a request is still read and served, alone,
so the bound would only serve the largest requests one at a time -- as the native front
end refuses one under its ``max_request_bytes``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid


def _serve_print_config(pool_mb: int, max_message_mb: int) -> subprocess.CompletedProcess[str]:
    frontend = {"type": "lmcache_mp", "max_message_mb": max_message_mb}
    return subprocess.run(
        [
            *(sys.executable, "-m", "lmcache_tiers.cli.main", "serve", "--print-config", "--no-default-l2"),
            *("--shm-name", f"tiers_mp_pool_{uuid.uuid4().hex[:10]}"),
            *("--frontend-pool-max-mb", str(pool_mb), "--frontend", json.dumps(frontend)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "40"},  # narrow: the line must not be wrapped
    )


def test_a_pool_byte_bound_under_max_message_mb_is_refused_in_one_line() -> None:
    refused = _serve_print_config(pool_mb=511, max_message_mb=512)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), refused.stderr
    assert "lmcache_mp" in lines[0], lines[0]
    assert "frontend_pool_max_mb 511" in lines[0] and "max_message_mb" in lines[0], lines[0]


def test_a_pool_byte_bound_holding_one_largest_message_is_taken() -> None:
    taken = _serve_print_config(pool_mb=512, max_message_mb=512)
    assert taken.returncode == 0, taken.stdout + taken.stderr
