"""A real server with the serde chain [fp8, zstd, aesgcm] on a nixl_store_dynamic adapter.

bf16 tensors stored through the client come back from L2 within fp8's bound; the files
on disk are ciphertext of exactly that chain; a damaged file, a tampered one whose record
checksum was fixed up, and a file copied under another key are all misses.
"""

from __future__ import annotations

import importlib.util
import os
import time
import zlib
from pathlib import Path
from typing import Any

import pytest
from tiers_e2e import ServerProcess, make_keys, start_server

from lmcache_tiers.client import Client
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2.record import decode_header, encode_header
from lmcache_tiers.serde import SerdeContext, decode_chain, encode_chain

_NEEDED = (
    "lmcache_plugin_nixl",
    "lmcache_plugin_serde_fp8",
    "lmcache_plugin_serde_zstd",
    "lmcache_plugin_serde_aesgcm",
)
_missing = [name for name in _NEEDED if importlib.util.find_spec(name) is None]
if _missing:
    pytest.skip(f"not installed: {', '.join(_missing)}", allow_module_level=True)

import torch  # noqa: E402 - only once the plugins (and torch with fp8) are known to be there
from lmcache_plugin_nixl.recordio import HEADER_ALIGN  # noqa: E402

from lmcache_tiers.plugin import FileLayout  # noqa: E402

SHAPE = (2, 4, 256, 256)  # 1 MiB of bf16 per chunk
COUNT = 6
KEY_BYTES = bytes(range(100, 132))


def _chain(key_file: Path) -> list[dict[str, Any]]:
    return [
        {"type": "fp8", "granularity": "channel"},
        {"type": "zstd", "level": 3},
        {"type": "aesgcm", "key_file": str(key_file)},
    ]


def _local_chain(key_file: Path) -> list[Any]:
    """The same chain built in this process, to check what the server wrote."""
    from lmcache_tiers.config import SerdeSpec, decode_component
    from lmcache_tiers.plugins import load_registry
    from lmcache_tiers.registry import Kind
    from lmcache_tiers.serde import build_serde_chain

    registry = load_registry()
    specs = []
    for index, raw in enumerate(_chain(key_file)):
        name, config = decode_component(registry, Kind.SERDE, raw, f"serde[{index}]")
        specs.append(SerdeSpec(type=name, config=config))
    return build_serde_chain(specs, registry)


def _tensors() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    tensors = []
    for index in range(COUNT):
        scale = torch.rand(SHAPE[-1], generator=generator) * 2 + 0.1
        tensors.append((torch.randn(SHAPE, generator=generator) * scale * (index + 1)).to(torch.bfloat16))
    return tensors


def _assert_within_fp8_bound(original: torch.Tensor, restored: torch.Tensor) -> None:
    """e4m3fn, one scale per channel: 2^-4 relative (+ bf16 rounding), or scale * 2^-10."""
    x, y = original.double().reshape(-1, SHAPE[-1]), restored.double().reshape(-1, SHAPE[-1])
    scale = x.abs().amax(dim=0) / 448.0
    allowed = (2.0**-4 + 2.0**-8 + 2.0**-12) * x.abs() + scale * 2.0**-10 * (1 + 2.0**-8)
    assert bool(((y - x).abs() <= allowed * (1 + 1e-6)).all()), "a value is outside fp8's bound"
    assert not torch.equal(x, y), "nothing was quantized"


def _wait_stored(client: Client, count: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while client.status()["adapters"][0]["keys_stored"] < count:
        assert time.monotonic() < deadline, "the store controller never wrote the chunks to L2"
        time.sleep(0.05)


def _backend(client: Client) -> dict[str, int]:
    stats: dict[str, int] = client.status()["adapters"][0]["backend"]
    return stats


def _rewrite(
    path: str, key: ObjectKey, payload: bytes, l1_size: int, serde: tuple[str, ...], layout: str = ""
) -> None:
    """A record with a valid header and checksum around ``payload`` (what an attacker with
    write access to the store can produce: the checksum is not a MAC)."""
    header = encode_header(key, payload, l1_size=l1_size, serde=serde, layout=layout, align=HEADER_ALIGN)
    Path(path).write_bytes(header + payload)


def _split(path: str, key: ObjectKey) -> tuple[Any, bytes]:
    data = Path(path).read_bytes()
    header = decode_header(data, expected_key=key)
    return header, data[header.header_len : header.header_len + header.payload_len]


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "tiers.key"
    path.write_bytes(KEY_BYTES.hex().encode() + b"\n")
    os.chmod(path, 0o600)
    return path


def test_fp8_zstd_aesgcm_chain_through_a_real_server(tmp_path: Path, key_file: Path) -> None:
    l2_dir = tmp_path / "l2"
    adapter = {
        "type": "nixl_store_dynamic",
        "backend": "POSIX",
        "backend_params": {"file_path": str(l2_dir), "use_direct_io": "false", "max_capacity_gb": "1"},
        "serde": _chain(key_file),
    }
    server: ServerProcess = start_server(tmp_path / "server", adapters=[adapter])
    keys = make_keys("serde-chain", COUNT)
    tensors = _tensors()
    layout = FileLayout(str(l2_dir), shard_dirs=False)
    try:
        with Client(server.url, timeout=60) as client:
            assert client.store(keys, tensors) == COUNT
            _wait_stored(client, COUNT)
            client.clear(force=True)
            assert client.status()["l1"]["objects"] == 0

            # Back from L2 (fp8 -> zstd -> aesgcm, decoded in reverse) within fp8's bound.
            assert client.lookup(keys) == COUNT
            with client.retrieve(keys) as views:
                restored = [torch.frombuffer(bytearray(v), dtype=torch.bfloat16).view(SHAPE) for v in views]
            for original, back in zip(tensors, restored, strict=True):
                _assert_within_fp8_bound(original, back)

            # On disk: the exact encoding of that chain, and nothing readable.
            chain = _local_chain(key_file)
            names = tuple(serde.name for serde in chain)
            for key, original, back in zip(keys, tensors, restored, strict=True):
                header, payload = _split(layout.path_for(key), key)
                assert header.serde == names == ("fp8", "zstd", "aesgcm")
                plain = original.view(torch.uint8).numpy().tobytes()
                decoded = decode_chain(chain, memoryview(payload), SerdeContext(key, len(plain)))
                assert bytes(decoded) == back.view(torch.uint8).numpy().tobytes()
                context = SerdeContext(key, len(plain), f"bfloat16[{','.join(map(str, SHAPE))}]")
                quantized = bytes(encode_chain(chain[:1], memoryview(plain), context))
                compressed = bytes(encode_chain(chain[:2], memoryview(plain), context))
                for inner in (plain, quantized, compressed):
                    for start in range(64, len(inner) - 32, max(1, len(inner) // 64)):
                        assert inner[start : start + 32] not in payload, "a plaintext run is on disk"
                assert len(zlib.compress(payload, 6)) > 0.99 * len(payload), "the file is compressible"

            client.clear(force=True)
            failures_before = _backend(client).get("serde_decode_failures", 0)

            # 1. A flipped byte on disk: the record checksum refuses it, a miss.
            path0 = layout.path_for(keys[0])
            damaged = bytearray(Path(path0).read_bytes())
            damaged[-100] ^= 0x01
            Path(path0).write_bytes(bytes(damaged))
            assert client.lookup(keys[:1]) == 0
            assert _backend(client)["corrupt_records_removed"] >= 1
            assert not Path(path0).exists()

            # 2. Tampered ciphertext under a recomputed record checksum: AES-GCM refuses it.
            header, payload = _split(layout.path_for(keys[1]), keys[1])
            tampered = bytearray(payload)
            tampered[len(tampered) // 2] ^= 0x01
            _rewrite(layout.path_for(keys[1]), keys[1], bytes(tampered), header.l1_size, header.serde)
            assert client.lookup(keys[1:2]) == 0

            # 3. A record copied under another key (valid header for that key): refused too.
            # Put there behind the server's back, it is looked for only by a lookup that
            # also names a key the server knows (a lookup of unknown keys alone is a miss
            # without reading anything): keys[2] in front of it.
            stranger = make_keys("serde-chain-stranger", 1)[0]
            header, payload = _split(layout.path_for(keys[2]), keys[2])
            _rewrite(layout.path_for(stranger), stranger, payload, header.l1_size, header.serde)
            assert client.lookup([keys[2], stranger]) == 1
            client.release(keys[2:3])
            assert _backend(client)["serde_decode_failures"] >= failures_before + 2

            # 4. The record's stated layout changed to another dtype of the same size (the
            # object would reach L1 as float16, and a later fp8 stage quantize it so):
            # aesgcm binds the layout its record states, a miss.
            header, payload = _split(layout.path_for(keys[3]), keys[3])
            assert header.layout.startswith("bfloat16[")
            forged = header.layout.replace("bfloat16", "float16")
            _rewrite(layout.path_for(keys[3]), keys[3], payload, header.l1_size, header.serde, forged)
            assert client.lookup(keys[3:4]) == 0
            assert _backend(client)["serde_aesgcm_layout_mismatch"] == 1

            # The untouched objects still load and decode.
            assert client.lookup(keys[4:]) == COUNT - 4
            client.release(keys[4:])
            assert client.status()["l1"]["read_locks"] == 0
    finally:
        assert server.stop() == 0, server.output()
    log = server.output()
    assert KEY_BYTES.hex() not in log and KEY_BYTES.hex().upper() not in log
    assert "serde decode failed" in log  # each refusal explained in one line
