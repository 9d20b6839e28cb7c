"""Start-up time of `lmcache-tiers plugins list` (limit: 1 s) and the heavy imports it avoids."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

from bench_args import BenchParser

LIMIT_S = 1.0
HEAVY = ("torch", "nixl", "s3fs", "redis", "zstandard")


def main() -> None:
    parser = BenchParser(__doc__)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON instead")
    args = parser.parse_args()
    command = [sys.executable, "-m", "lmcache_tiers.cli.main", "plugins", "list", "--json"]
    times = []
    for _ in range(args.runs):
        start = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    probe = (
        "import sys; from lmcache_tiers.cli.main import main\n"
        "try:\n    main(['plugins', 'list', '--json'])\nexcept SystemExit:\n    pass\n"
        f"print('HEAVY=' + ','.join(m for m in {HEAVY!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout
    heavy = out.rsplit("HEAVY=", 1)[-1].strip()
    median = statistics.median(times)
    if args.json:
        print(
            json.dumps({"median_s": median, "max_s": max(times), "limit_s": LIMIT_S, "heavy_modules": heavy})
        )
        return
    print(
        f"plugins list start-up: median {median:.3f} s, max {max(times):.3f} s (limit {LIMIT_S:.1f} s) "
        f"-> {'OK' if median < LIMIT_S else 'OVER LIMIT'}"
    )
    print(f"heavy modules imported by plugins list: {heavy or 'none'}")


if __name__ == "__main__":
    main()
