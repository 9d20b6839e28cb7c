"""``lmcache bench server`` whose pauses end when the server has put away what it wrote.

Usage: ``python lmcache_ref_bench_paced.py STATUS_URL BENCH_ARGS...`` with LMCache 0.5.6
importable.  The bench pauses ``--interval`` seconds after each cold and each warm pass;
a test that needs the warm pass served from L2 would otherwise pick one interval long
enough for the slowest machine (the L2 store and skip_l1's removal from L1 both happen
behind the client's back).  Here each pause instead lasts until the server's
``/status`` says every chunk written so far is in its first L2 adapter and L1 holds no
object; ``--interval`` is only the bound, and a pause that reaches it ends the bench with
exit status 3 and the last status read, so a test is told the chunks never left L1
rather than reading a warm pass served from L1 as a failed L2 load.  Everything else is
LMCache's own bench, unchanged.
"""

from __future__ import annotations

import json
import sys
import time
import types
import urllib.request
from typing import Any

from lmcache.cli.commands.bench.server_bench.cases import baseline
from lmcache.cli.main import main

POLL_S = 0.05


def read_status(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as response:
        status: dict[str, Any] = json.loads(response.read())
    return status


def put_away(status: dict[str, Any]) -> bool:
    """Every chunk written is in L2, and L1 holds nothing (skip_l1 dropped what L2 has,
    the prefetches of a warm pass gave back what they loaded)."""
    written = status["requests"]["keys_written"]
    return status["adapters"][0].get("keys_stored", 0) == written and status["l1"]["objects"] == 0


def pause_until_put_away(url: str, bound_s: float) -> None:
    deadline = time.monotonic() + bound_s
    while not put_away(status := read_status(url)):
        if time.monotonic() > deadline:
            print(
                f"the server never put away what it wrote within {bound_s} s: "
                f"requests {status['requests']}, L1 {status['l1']}, L2 {status['adapters'][0]}",
                file=sys.stderr,
            )
            sys.exit(3)
        time.sleep(POLL_S)


if __name__ == "__main__":
    status_url, *bench_args = sys.argv[1:]
    # The baseline case calls time.sleep(interval) between passes and nothing else of time.
    baseline.time = types.SimpleNamespace(sleep=lambda seconds: pause_until_put_away(status_url, seconds))  # type: ignore[attr-defined]
    sys.argv = ["lmcache", *bench_args]
    sys.exit(main())
