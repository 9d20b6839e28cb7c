"""Serde throughput, size ratio and fp8 error on bf16 KV-shaped objects, next to memcpy.

The object set (default 8 objects of bf16[2,8,256,1024], 8 MiB each, 64 MiB) comes from
``lmcache_tiers.testing.serde.kv_like_bf16``: synthetic KV with per-channel scales and
outlier channels in K, the stand-in every serde test uses.  For each serde, and for the
chain [fp8, zstd, aesgcm], every round encodes and decodes the whole set and copies the
same bytes with ``np.copyto`` (memcpy); figures are medians over ``--repeat`` rounds, in GB
of L1 (decoded) bytes per second, with memcpy's median of the same rounds beside them.
``lz4`` rows (a candidate, not shipped) appear when the ``lz4`` package is importable.

End to end: a ``nixl_store_dynamic`` adapter (POSIX backend, a temporary directory, page
cache) stores and loads the set through its non-blocking interface, without a serde and
with the chain; the serde work runs on the adapter's store and load threads.

    python bench/bench_serde.py [--count 8] [--shape 2,8,256,1024] [--repeat 5] [--dir DIR] [--json]
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
from bench_args import BenchParser, at_least_one, dimensions

from lmcache_tiers.config import SerdeSpec, decode_component
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.registry import Kind
from lmcache_tiers.serde import Serde, SerdeContext, build_serde_chain, decode_chain, encode_chain
from lmcache_tiers.testing.serde import kv_layout, kv_like_bf16

GB = 1e9
KEY_ENV = "BENCH_SERDE_AESGCM_KEY"


@dataclass
class Row:
    name: str
    encode_s: list[float] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)
    memcpy_s: list[float] = field(default_factory=list)
    ratio: float = 0.0
    errors: dict[str, float] | None = None


def build_chain(specs: Sequence[dict[str, Any]]) -> list[Serde]:
    registry = load_registry()
    resolved = []
    for index, raw in enumerate(specs):
        name, config = decode_component(registry, Kind.SERDE, raw, f"serde[{index}]")
        resolved.append(SerdeSpec(type=name, config=config))
    return build_serde_chain(resolved, registry)


class _Lz4:
    """lz4 block compression (optionally of byte planes), for comparison only."""

    def __init__(self, shuffle: bool) -> None:
        import lz4.block
        from lmcache_plugin_serde_zstd.shuffle import shuffle_into, unshuffle_into

        self.name, self.shuffle = "lz4", shuffle
        self._lz4, self._shuffle, self._unshuffle = lz4.block, shuffle_into, unshuffle_into

    def encode(self, data: memoryview, context: SerdeContext) -> bytes:
        source = data
        if self.shuffle:
            planes = bytearray(data.nbytes)
            self._shuffle(data, memoryview(planes), 2)
            source = memoryview(planes)
        return bytes(self._lz4.compress(source, store_size=False))

    def decode(self, data: memoryview, context: SerdeContext) -> bytes | memoryview:
        out = self._lz4.decompress(data, uncompressed_size=context.size)
        if not self.shuffle:
            return out
        restored = bytearray(len(out))
        self._unshuffle(memoryview(out), memoryview(restored), 2)
        return memoryview(restored)


def bf16_to_float64(data: bytes | memoryview) -> np.ndarray[Any, Any]:
    return (np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def fp8_errors(originals: list[bytes], decoded: list[bytes], smallest_normal: float) -> dict[str, float]:
    """Max relative error over elements in fp8's normal range (per-tensor scale), mean
    relative error over nonzero elements, and relative RMS error."""
    worst, total, count, squared, energy = 0.0, 0.0, 0, 0.0, 0.0
    for original, back in zip(originals, decoded, strict=True):
        x, y = bf16_to_float64(original), bf16_to_float64(back)
        error, magnitude = np.abs(y - x), np.abs(x)
        normal = magnitude >= magnitude.max() / 448.0 * smallest_normal
        worst = max(worst, float((error[normal] / magnitude[normal]).max()))
        nonzero = magnitude > 0
        total += float((error[nonzero] / magnitude[nonzero]).sum())
        count += int(nonzero.sum())
        squared += float((error**2).sum())
        energy += float((x**2).sum())
    return {"max_rel_normal": worst, "mean_rel": total / count, "rel_rms": (squared / energy) ** 0.5}


def measure(
    row: Row, chain: Sequence[Any], objects: list[bytes], layout: str, repeat: int, check: Callable[..., None]
) -> None:
    keys = [ObjectKey("bench", 0, i.to_bytes(8, "big")) for i in range(len(objects))]
    targets = [np.empty(len(o), np.uint8) for o in objects]
    # One untimed pass: first use of a library and first touch of fresh memory are slow.
    warm = encode_chain(chain, memoryview(objects[0]), SerdeContext(keys[0], len(objects[0]), layout))
    decode_chain(chain, memoryview(bytes(warm)), SerdeContext(keys[0], len(objects[0])))
    for _ in range(repeat):
        start = time.perf_counter()
        encoded = [
            bytes(encode_chain(chain, memoryview(o), SerdeContext(k, len(o), layout)))
            for k, o in zip(keys, objects, strict=True)
        ]
        row.encode_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        decoded = [
            decode_chain(chain, memoryview(e), SerdeContext(k, len(o)))
            for k, e, o in zip(keys, encoded, objects, strict=True)
        ]
        row.decode_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        for target, o in zip(targets, objects, strict=True):
            np.copyto(target, np.frombuffer(o, np.uint8))
        row.memcpy_s.append(time.perf_counter() - start)
    row.ratio = sum(map(len, encoded)) / sum(map(len, objects))
    check(row, objects, [bytes(d) for d in decoded])


def lossless(row: Row, objects: list[bytes], decoded: list[bytes]) -> None:
    if decoded != objects:
        raise SystemExit(f"{row.name}: decoded bytes differ")


def lossy(smallest_normal: float) -> Callable[[Row, list[bytes], list[bytes]], None]:
    def check(row: Row, objects: list[bytes], decoded: list[bytes]) -> None:
        row.errors = fp8_errors(objects, decoded, smallest_normal)

    return check


def end_to_end(objects: list[bytes], layout: str, chain: list[dict[str, Any]], root: str, repeat: int) -> Row:
    from lmcache_plugin_nixl.config import NixlStoreDynamicConfig
    from lmcache_plugin_nixl.dynamic import NixlDynamicBackend

    from lmcache_tiers.l2 import AdapterContext, create_adapter
    from lmcache_tiers.testing.blocking import BlockingAdapterClient

    total = sum(map(len, objects))
    arena = mmap.mmap(-1, 2 * total)
    view = memoryview(arena)
    sources, targets, offset = [], [], 0
    for data in objects:
        view[offset : offset + len(data)] = data
        sources.append(view[offset : offset + len(data)])
        targets.append(view[total + offset : total + offset + len(data)])
        offset += len(data)
    config = msgspec.convert(
        {
            "backend": "POSIX",
            "backend_params": {
                "file_path": root,
                "use_direct_io": "false",
                "max_capacity_gb": str(4 * total / (1 << 30)),
            },
            "serde": chain,
        },
        NixlStoreDynamicConfig,
    )
    name = "nixl_store_dynamic" + (" + [" + ", ".join(s["type"] for s in chain) + "]" if chain else "")
    adapter = create_adapter(
        NixlDynamicBackend,
        config,
        AdapterContext(0, "0:nixl_store_dynamic", config, serde=build_chain(chain), l1_buffer=view),
    )
    client = BlockingAdapterClient(adapter, timeout=600)
    keys = [ObjectKey("bench", 0, i.to_bytes(8, "big")) for i in range(len(objects))]
    row = Row(name)
    try:
        for round_index in range(repeat + 1):  # round 0 warms up and is not counted
            adapter.delete(keys)
            os.sync()
            start = time.perf_counter()
            if client.store(keys, sources, layouts=[layout] * len(keys)) != [True] * len(keys):
                raise SystemExit(f"{name}: store failed: {adapter.stats()}")
            store_s = time.perf_counter() - start
            os.sync()
            for target in targets:
                target[:] = bytes(len(target))
            start = time.perf_counter()
            if client.load(keys, targets) != [True] * len(keys):
                raise SystemExit(f"{name}: load failed: {adapter.stats()}")
            load_s = time.perf_counter() - start
            start = time.perf_counter()
            for target, source in zip(targets, sources, strict=True):
                np.copyto(np.frombuffer(target, np.uint8), np.frombuffer(source, np.uint8))
            if round_index:
                row.encode_s.append(store_s)
                row.decode_s.append(load_s)
                row.memcpy_s.append(time.perf_counter() - start)
        row.ratio = adapter.used_bytes() / total
        if not chain and any(bytes(t) != bytes(s) for s, t in zip(sources, targets, strict=True)):
            raise SystemExit(f"{name}: loaded bytes differ")
    finally:
        adapter.close()
    return row


def main() -> None:
    parser = BenchParser(__doc__)
    parser.add_argument("--count", type=at_least_one, default=8, help="objects in the set")
    parser.add_argument("--shape", type=dimensions, default="2,8,256,1024", help="bf16 shape of each object")
    parser.add_argument("--repeat", type=at_least_one, default=5)
    parser.add_argument("--dir", help="directory for the adapter's files (default: a temp dir)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    shape = args.shape
    layout = kv_layout(shape)
    objects = [kv_like_bf16(shape, seed) for seed in range(args.count)]
    total = sum(map(len, objects))
    os.environ.setdefault(KEY_ENV, os.urandom(32).hex())
    aes = {"type": "aesgcm", "key_env": KEY_ENV}
    full_chain = [{"type": "fp8"}, {"type": "zstd"}, aes]
    cases: list[tuple[str, list[Any], Callable[..., None]]] = [
        ("fp8 e4m3fn tensor", build_chain([{"type": "fp8"}]), lossy(2.0**-6)),
        ("fp8 e4m3fn channel", build_chain([{"type": "fp8", "granularity": "channel"}]), lossy(2.0**-6)),
        ("fp8 e5m2 tensor", build_chain([{"type": "fp8", "format": "e5m2"}]), lossy(2.0**-14)),
        ("zstd 1 shuffle", build_chain([{"type": "zstd"}]), lossless),
        ("zstd 1 no shuffle", build_chain([{"type": "zstd", "shuffle": False}]), lossless),
        ("zstd 3 shuffle", build_chain([{"type": "zstd", "level": 3}]), lossless),
        ("aesgcm", build_chain([aes]), lossless),
        ("fp8 + zstd + aesgcm", build_chain(full_chain), lossy(2.0**-6)),
    ]
    try:
        cases += [
            ("lz4 shuffle (not shipped)", [_Lz4(True)], lossless),
            ("lz4 (not shipped)", [_Lz4(False)], lossless),
        ]
    except ImportError as exc:
        print(f"lz4 rows skipped: {exc}")
    rows = []
    for name, chain, check in cases:
        row = Row(name)
        measure(row, chain, objects, layout, args.repeat, check)
        rows.append(row)
    root = tempfile.mkdtemp(prefix="bench-serde-", dir=args.dir)
    try:
        rows.append(end_to_end(objects, layout, [], os.path.join(root, "plain"), args.repeat))
        rows.append(end_to_end(objects, layout, full_chain, os.path.join(root, "chain"), args.repeat))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def gbps(times: list[float]) -> float:
        return total / statistics.median(times) / GB

    if args.json:
        print(
            json.dumps(
                [
                    {
                        "name": r.name,
                        "encode_gbps": gbps(r.encode_s),
                        "decode_gbps": gbps(r.decode_s),
                        "memcpy_gbps": gbps(r.memcpy_s),
                        "ratio": r.ratio,
                        "errors": r.errors,
                    }
                    for r in rows
                ],
                indent=2,
            )
        )
        return
    size_mib = total / (1 << 20)
    print(
        f"{args.count} objects of bfloat16[{','.join(map(str, shape))}] = {size_mib:.0f} MiB; "
        f"median of {args.repeat} rounds"
    )
    print(f"{'serde':<42} {'enc GB/s':>8} {'dec GB/s':>8} {'memcpy':>7} {'ratio':>6}  fp8 error")
    for r in rows:
        error = (
            f"max rel {r.errors['max_rel_normal']:.4f} (normal range), mean rel {r.errors['mean_rel']:.4f}, "
            f"rel rms {r.errors['rel_rms']:.4f}"
            if r.errors
            else ""
        )
        label = r.name if not r.name.startswith("nixl") else r.name + " store/load"
        figures = f"{gbps(r.encode_s):>8.2f} {gbps(r.decode_s):>8.2f} {gbps(r.memcpy_s):>7.2f}"
        print(f"{label:<42} {figures} {r.ratio:>6.3f}  {error}")


if __name__ == "__main__":
    main()
