"""The fs adapter: store/load GB/s next to plain pwrite/preadv, the start-up scan rate, and
fs next to the reference LMCache's own ``lmcache bench l2`` fs adapter.

Three parts, each printing its figure next to the limit measured in the same run:

* ``throughput`` -- 256 x 1 MiB and 64 x 16 MiB (``--cases``) stored and loaded through the
  adapter's non-blocking interface (one batch) and with plain ``os.pwrite`` into one new
  file per object / ``os.preadv`` of the same bytes from the same page-aligned buffers
  (``O_DIRECT`` for both with ``--direct-io``).  Methods alternate round by round; each
  figure is the median of ``--repeat`` rounds and a ratio the median of per-round ratios
  (target >= 0.8).  Loads come from the page cache unless ``--direct-io``.
* ``scan`` -- ``--scan-objects`` (100,000) small records created on disk, then the time
  from building the adapter until its start-up scan has accounted them all (flat and
  sharded), next to a bare ``os.scandir`` + one ``stat`` per file of the same tree.
* ``reference`` -- ``lmcache bench l2`` with LMCache's fs adapter (``base_path``) from the
  reference venv (``--reference-venv``; ``DO_NOT_TRACK=1``) and the same workload through
  fs: ``--ref-keys`` keys of 1 MiB per round, ``--repeat`` rounds after one warm-up.  The
  two take turns round by round (alternating which goes first); each store starts after
  a ``sync`` and each load after its files were written back and evicted from the page
  cache, so both load from the disk: as root this writes ``3`` to
  ``/proc/sys/vm/drop_caches``, dropping the page, dentry and inode caches of the whole
  machine; where that cannot be written, ``posix_fadvise(DONTNEED)`` on each file (the
  method used is printed with the figures).
  GB/s from the median round of each, the ratio the median of per-round ratios (target:
  fs >= 1.5x).  The reference runs one ``lmcache bench l2 --only store|load`` per round
  and side, each with a warm-up round of its own.

    python bench/bench_fs.py [--dir /mnt/nvme] [--parts throughput,scan,reference]
        [--cases 256x1,64x16] [--repeat 5] [--direct-io] [--scan-objects 100000]
"""

from __future__ import annotations

import json
import mmap
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
from bench_args import BenchParser, at_least_one
from cases import Case, check_whole, parse_cases
from lmcache_plugin_fs import FsConfig
from lmcache_plugin_fs.backend import FsBackend

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import AdapterContext, L2Adapter, create_adapter
from lmcache_tiers.l2.files import FileLayout, record_name
from lmcache_tiers.testing.blocking import BlockingAdapterClient

MIB = 1 << 20
GB = 1e9
HEADER = 4096
_DIRECT = getattr(os, "O_DIRECT", 0)

#: where scripts/install_reference_lmcache.sh installs LMCache 0.5.6 (LMCACHE_REF_VENV moves it)
_CACHE_HOME = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
REFERENCE_VENV = Path(os.environ.get("LMCACHE_REF_VENV", _CACHE_HOME / "lmcache-tiers" / "lmcache-0.5.6"))


def keys_for(tag: str, count: int) -> list[ObjectKey]:
    return [ObjectKey("bench-model", 0, f"{tag}-{i}".encode().ljust(32, b"\0")[:32]) for i in range(count)]


def open_fs(root: str, arena: memoryview, **fields: object) -> L2Adapter:
    config = msgspec.convert({"path": root, **fields}, FsConfig)
    facts = AdapterContext(index=0, name="0:fs", config=config, l1_buffer=arena)
    return create_adapter(FsBackend, config, facts)


class Arena:
    """Page-aligned, pre-faulted buffers: one per object, filled with distinct bytes."""

    def __init__(self, count: int, size: int) -> None:
        self.map = mmap.mmap(-1, count * size)
        self.view = memoryview(self.map)
        self.sources = [self.view[i * size : (i + 1) * size] for i in range(count)]
        for index, source in enumerate(self.sources):
            source[:] = os.urandom(64) * (size // 64) if index == 0 else self.sources[0]
            source[:8] = index.to_bytes(8, "big")


# -- throughput ---------------------------------------------------------------------------


def raw_store(directory: str, sources: list[memoryview], direct: bool) -> float:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (_DIRECT if direct else 0)
    start = time.perf_counter()
    for index, source in enumerate(sources):
        fd = os.open(os.path.join(directory, f"raw-{index}.bin"), flags, 0o644)
        written = os.pwrite(fd, source, 0)
        os.close(fd)
        check_whole("raw pwrite", index, written, len(source))
    return time.perf_counter() - start


def raw_load(directory: str, targets: list[memoryview], direct: bool) -> float:
    flags = os.O_RDONLY | (_DIRECT if direct else 0)
    start = time.perf_counter()
    for index, target in enumerate(targets):
        fd = os.open(os.path.join(directory, f"raw-{index}.bin"), flags)
        read = os.preadv(fd, [target], 0)
        os.close(fd)
        check_whole("raw preadv", index, read, len(target))
    return time.perf_counter() - start


def adapter_round(
    client: BlockingAdapterClient, keys: list[ObjectKey], buffers: list[memoryview], store: bool
) -> float:
    start = time.perf_counter()
    results = client.store(keys, buffers) if store else client.load(keys, buffers)
    elapsed = time.perf_counter() - start
    if results != [True] * len(keys):
        raise SystemExit(f"{'store' if store else 'load'} failed for {results.count(False)} objects")
    return elapsed


#: every figure this run printed, for ``--json`` and bench/run_all.py
FIGURES: list[dict[str, object]] = []


def throughput(root: str, given: Case, repeat: int, direct: bool) -> None:
    count, size, total, case = given.count, given.size, given.total, given.tag
    arena = Arena(count * 2, size)
    sources, targets = arena.sources[:count], arena.sources[count:]
    raw_dir = os.path.join(root, f"raw-{case}")
    fs_dir = os.path.join(root, f"fs-{case}")
    os.makedirs(raw_dir)
    adapter = open_fs(fs_dir, arena.view, use_odirect=direct)
    client = BlockingAdapterClient(adapter, timeout=600)
    keys = keys_for(case, count)
    rows: dict[str, list[float]] = {"raw store": [], "fs store": [], "raw load": [], "fs load": []}
    try:
        for _round in range(repeat + 1):  # the first round warms up files, caches and threads
            adapter.delete(keys)
            for name in os.listdir(raw_dir):
                os.unlink(os.path.join(raw_dir, name))
            # Each store starts with no dirty pages (so neither pays for the other's
            # writeback), and the order alternates by round.
            timings: dict[str, float] = {}
            order = ["raw", "fs"] if _round % 2 else ["fs", "raw"]
            for method in order:
                os.sync()
                timings[f"{method} store"] = (
                    raw_store(raw_dir, sources, direct)
                    if method == "raw"
                    else adapter_round(client, keys, sources, store=True)
                )
            for method in order:
                timings[f"{method} load"] = (
                    raw_load(raw_dir, targets, direct)
                    if method == "raw"
                    else adapter_round(client, keys, targets, store=False)
                )
            if _round:
                for name, seconds in timings.items():
                    rows[name].append(total / seconds / GB)
    finally:
        adapter.close()
    mode = "O_DIRECT" if direct else "page cache"
    for op in ("store", "load"):
        raw, ours = rows[f"raw {op}"], rows[f"fs {op}"]
        ratio = statistics.median(o / r for o, r in zip(ours, raw, strict=True))
        FIGURES.append(
            {
                "part": "throughput", "case": case, "op": op, "mode": mode,
                "fs_gbps": statistics.median(ours),
                "raw_gbps": statistics.median(raw), "ratio": ratio,
            }
        )  # fmt: skip
        print(
            f"{case.replace('x', ' x ')} MiB {op:5}  fs {statistics.median(ours):6.2f} GB/s   "
            f"raw {'pwrite' if op == 'store' else 'preadv'} {statistics.median(raw):6.2f} GB/s   "
            f"ratio {ratio:4.2f}  ({mode}, median of {repeat})"
        )


# -- scan ---------------------------------------------------------------------------------


def make_records(root: str, count: int, sharded: bool) -> None:
    """``count`` record files named for their keys, 4 KiB header + 16 bytes each (sparse)."""
    layout = FileLayout(root, shard_dirs=sharded)
    made: set[str] = set()
    for key in keys_for("scan", count):
        directory = layout.directory_for(key)
        if directory not in made:
            os.makedirs(directory, exist_ok=True)
            made.add(directory)
        fd = os.open(os.path.join(directory, record_name(key)), os.O_WRONLY | os.O_CREAT, 0o644)
        os.ftruncate(fd, HEADER + 16)
        os.close(fd)


def bare_listing(root: str) -> tuple[int, float]:
    start = time.perf_counter()
    count = 0
    pending = [root]
    while pending:
        with os.scandir(pending.pop()) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    pending.append(entry.path)
                else:
                    entry.stat(follow_symlinks=False)
                    count += 1
    return count, time.perf_counter() - start


def scan(root: str, count: int) -> None:
    for sharded in (False, True):
        directory = os.path.join(root, f"scan-{'sharded' if sharded else 'flat'}")
        make_records(directory, count, sharded)
        os.system("sync")
        listed, bare = bare_listing(directory)
        block = mmap.mmap(-1, MIB)
        start = time.perf_counter()
        adapter = open_fs(directory, memoryview(block), max_capacity_gb=1024, shard_dirs=sharded)
        while adapter.stats().get("scan_running", 0):
            time.sleep(0.001)
        elapsed = time.perf_counter() - start
        scanned = adapter.stats()["scan_keys"]
        adapter.close()
        if scanned != count or listed != count:
            raise SystemExit(f"scan accounted {scanned}, listing saw {listed}, of {count}")
        FIGURES.append(
            {
                "part": "scan", "sharded": sharded, "objects": count, "fs_per_s": count / elapsed,
                "bare_per_s": count / bare, "ratio": bare / elapsed,
            }
        )  # fmt: skip
        print(
            f"scan {count:,} objects {'sharded' if sharded else 'flat   '}  "
            f"fs {count / elapsed:9,.0f} objects/s   bare scandir+stat {count / bare:9,.0f} objects/s   "
            f"ratio {bare / elapsed:4.2f}   (goal >= 50,000/s)"
        )


# -- the reference ---------------------------------------------------------------------------


def _reference_figures(output: str, op: str) -> float:
    section = output.split(f" {op} ")[1] if f" {op} " in output else ""
    found = re.search(r"Duration avg \(ms\):\s+([0-9.]+)", section)
    if found is None:
        raise SystemExit(f"cannot read the reference's {op} duration:\n{output[-2000:]}")
    return float(found.group(1)) / 1000


DROP_CACHES = "/proc/sys/vm/drop_caches"


def drop_page_cache(directories: list[str], control: str = DROP_CACHES) -> str:
    """Write back, then evict from the page cache, every file under ``directories``, so the
    loads that follow read the disk.  ``/proc/sys/vm/drop_caches`` when this process may
    write it (root, outside a restricted container); otherwise ``posix_fadvise(DONTNEED)``
    on each file, which evicts the clean pages the ``sync`` left.  Returns the method."""
    os.sync()
    try:
        with open(control, "w") as caches:
            caches.write("3")
        return "drop_caches"
    except OSError:
        pass  # not root, or a read-only /proc/sys (a container): evict file by file
    for directory in directories:
        for parent, _dirs, names in os.walk(directory):
            for name in names:
                try:
                    fd = os.open(os.path.join(parent, name), os.O_RDONLY)
                except FileNotFoundError:
                    continue  # removed since it was listed: nothing of it to evict
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
    return "posix_fadvise DONTNEED"


def reference_round(cli: Path, directory: str, keys: int, op: str) -> float:
    """Seconds of one measured ``lmcache bench l2`` round of ``op`` (store or load), after
    one warm-up round in the same process.  The store and the load of one directory use the
    same keys (the reference numbers its keys by round, the same in both runs)."""
    env = {**os.environ, "DO_NOT_TRACK": "1", "LMCACHE_TRACK_USAGE": "false"}
    spec = msgspec.json.encode({"type": "fs", "base_path": directory}).decode()
    command = [str(cli), "bench", "l2", "--l2-adapter", spec, "--num-keys", str(keys)]
    command += ["--data-size-kb", "1024", "--only", op, "--rounds", "1", "--warmup-rounds", "1"]
    command += ["--l1-align-bytes", "4096"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    if result.returncode != 0:
        raise SystemExit(f"lmcache bench l2 failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    return _reference_figures(result.stdout, op.capitalize())


def reference(root: str, venv: Path, keys: int, repeat: int) -> None:
    cli = venv / "bin" / "lmcache"
    if not cli.exists():
        print(f"reference: skipped, {cli} is not installed")
        FIGURES.append({"part": "reference", "skipped": f"{cli} is not installed"})
        return
    ref_root = os.path.join(root, "reference")
    ours_dir = os.path.join(root, "versus")
    arena = Arena(keys, MIB)
    adapter = open_fs(ours_dir, arena.view)
    client = BlockingAdapterClient(adapter, timeout=600)
    seconds: dict[str, list[float]] = {
        "fs store": [],
        "fs load": [],
        "reference store": [],
        "reference load": [],
    }
    evicted_by = ""
    try:
        # Rounds alternate which side goes first, and each side's store starts with no dirty
        # pages and its load with none of its files in the page cache, so neither side is
        # measured from memory while the other reads the disk.
        for round_index in range(repeat + 1):  # round 0 warms up and is not counted
            timings: dict[str, float] = {}
            order = ["reference", "fs"] if round_index % 2 else ["fs", "reference"]
            for side in order:
                if side == "reference":
                    directory = os.path.join(ref_root, f"round{round_index}")
                    os.sync()
                    timings["reference store"] = reference_round(cli, directory, keys, "store")
                    evicted_by = drop_page_cache([directory])
                    timings["reference load"] = reference_round(cli, directory, keys, "load")
                    shutil.rmtree(directory, ignore_errors=True)
                else:
                    round_keys = keys_for(f"round{round_index}", keys)
                    os.sync()
                    timings["fs store"] = adapter_round(client, round_keys, arena.sources, store=True)
                    evicted_by = drop_page_cache([ours_dir])
                    timings["fs load"] = adapter_round(client, round_keys, arena.sources, store=False)
                    adapter.delete(round_keys)
            if round_index:
                for name, value in timings.items():
                    seconds[name].append(value)
    finally:
        adapter.close()
    total = keys * MIB
    for op in ("store", "load"):
        ours, theirs = seconds[f"fs {op}"], seconds[f"reference {op}"]
        ratio = statistics.median(t / o for o, t in zip(ours, theirs, strict=True))
        fs_gbps, reference_gbps = total / statistics.median(ours) / GB, total / statistics.median(theirs) / GB
        FIGURES.append(
            {
                "part": "reference", "case": f"{keys}x1", "op": op, "fs_gbps": fs_gbps,
                "reference_gbps": reference_gbps, "ratio": ratio, "page_cache_evicted_by": evicted_by,
            }
        )  # fmt: skip
        print(
            f"vs reference, {keys} x 1 MiB {op:5}  fs {fs_gbps:6.2f} GB/s   "
            f"lmcache 0.5.6 fs {reference_gbps:6.2f} GB/s   ratio {ratio:4.2f}x   "
            f"(target >= 1.5x; median of {repeat} interleaved rounds, loads from disk: {evicted_by})"
        )


PARTS = ("throughput", "scan", "reference")


def main() -> None:
    parser = BenchParser(__doc__)
    parser.add_argument("--dir", default=None, help="filesystem to measure (default: the temp directory)")
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated parts to run")
    parser.add_argument("--cases", type=parse_cases, default="256x1,64x16", help="COUNTxMIB,...")
    parser.add_argument("--repeat", type=at_least_one, default=5)
    parser.add_argument("--direct-io", action="store_true")
    parser.add_argument("--scan-objects", type=at_least_one, default=100_000)
    parser.add_argument("--ref-keys", type=at_least_one, default=64)
    parser.add_argument("--reference-venv", type=Path, default=REFERENCE_VENV)
    parser.add_argument(
        "--json", action="store_true", help="also print the figures as one JSON line at the end"
    )
    args = parser.parse_args()
    chosen = args.parts.split(",")
    unknown = [part for part in chosen if part not in PARTS]
    if unknown:
        parser.error(f"--parts: unknown part {unknown[0]!r}; choose from {', '.join(PARTS)}")
    root = tempfile.mkdtemp(prefix="bench-fs-", dir=args.dir)
    parts: dict[str, Callable[[], None]] = {
        "throughput": lambda: (
            [throughput(root, case, args.repeat, args.direct_io) for case in args.cases] and None
        ),
        "scan": lambda: scan(root, args.scan_objects),
        "reference": lambda: reference(root, args.reference_venv, args.ref_keys, args.repeat),
    }
    try:
        for part in chosen:
            parts[part]()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(FIGURES))


if __name__ == "__main__":
    main()
