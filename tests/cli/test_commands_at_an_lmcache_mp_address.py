"""``status``, ``bench`` and ``replay --url`` speak the native protocol.  Pointed at the
address of a running server's ``lmcache_mp`` front end (``serve --frontend '{"type":
"lmcache_mp", "port": 5555}'`` on the default URL's port), they get no answer: the error
line must not leave the operator thinking the server is down."""

from __future__ import annotations

import json
from pathlib import Path

from thirdparty import free_port, launch_serve, run_cli, wait_for


def test_status_at_an_lmcache_mp_front_end_says_it_needs_a_native_one(tmp_path: Path) -> None:
    port = free_port()
    server = launch_serve(
        ["--l1-size-gb", "0.0625", "--no-default-l2", "--frontend", json.dumps({"type": "lmcache_mp"})],
        None,
        tmp_path / "log",
        port=port,
    )
    try:
        wait_for(server, lambda: "serving 0:lmcache_mp on" in server.output(), "start-up")
        url = f"tcp://127.0.0.1:{port}"
        result = run_cli(["status", "--url", url, "--timeout", "1"])
        assert result.returncode == 1, result.stderr
        assert result.stderr.strip().splitlines()[-1] == (
            f"error: cannot get the status of {url}: no answer within --timeout 1 s: is the server "
            "running, with a native front end listening there? (an lmcache_mp front end does not "
            "answer this command)"
        )
    finally:
        assert server.stop() == 0, server.output()
