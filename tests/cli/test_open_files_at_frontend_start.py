"""A front end's ZeroMQ context starts its reaper and I/O threads with the first socket,
and libzmq aborts the whole process (an assertion, SIGABRT) when it cannot create their
pollers (or resolve the address it binds).  Under an open files limit just above the
pre-flight's floor, serve with an L2 adapter and two front ends died that way on some
limits (20 to 22, 30), leaving its L1 segment behind, instead of refusing in its one line
as it did on the limits in between."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import uuid
from pathlib import Path

import pytest
from startup_refusals import NARROW
from thirdparty import CLI, free_port

from lmcache_tiers.plugins import load_registry
from lmcache_tiers.registry import Kind
from lmcache_tiers.server import preflight

#: limits from the pre-flight's floor to below what this configuration needs to start
LIMITS = range(preflight.SERVE_OPEN_FILES, 32)


def test_no_limit_too_low_for_the_front_ends_aborts_the_process(tmp_path: Path) -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < LIMITS[-1]:
        pytest.skip(f"the hard limit of open files here is {hard}, below {LIMITS[-1]}")
    if not {"fs"} <= set(load_registry().names(Kind.L2_ADAPTER)):
        pytest.skip("the fs adapter plugin is not installed")
    outcomes = {}
    for limit in LIMITS:
        shm = f"tiers_nofile_{uuid.uuid4().hex[:10]}"
        result = subprocess.run(
            [
                *CLI,
                "serve",
                "--l1-size-gb",
                "0.0625",
                "--shm-name",
                shm,
                "--metrics-port",
                "0",
                "--l2-adapter",
                json.dumps({"type": "fs", "path": str(tmp_path / "l2")}),
                "--frontend",
                json.dumps({"type": "native", "port": free_port()}),
                "--frontend",
                json.dumps({"type": "lmcache_mp", "port": free_port()}),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, **NARROW},
            preexec_fn=lambda limit=limit: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit)),
        )
        left = Path(f"/dev/shm/{shm}")
        left_behind = left.exists()  # an aborted process unlinks nothing
        left.unlink(missing_ok=True)
        last = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ""
        outcomes[limit] = (result.returncode, last, left_behind)
    expected = {
        limit: (
            2,
            f"error: ulimit -n {limit}: serve ran out of open files while starting "
            f"(each L2 adapter and front end takes some); raise the hard limit "
            f"(ulimit -Hn {preflight.RECOMMENDED_OPEN_FILES}, or LimitNOFILE= in a systemd unit)",
            False,
        )
        for limit in LIMITS
    }
    assert outcomes == expected
