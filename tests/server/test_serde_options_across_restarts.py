"""A server restarted over its fs L2 with other options inside its serdes -- fp8's format and
granularity, zstd's level, shuffle and element size -- keeps the chain's names, so every
record stays readable: each frame states what wrote it.  A chunk the earlier options wrote
comes back within the error bound of those options (fp8), or with its own bytes (zstd);
never decoded as if the new options had written it."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any

import pytest
from tiers_e2e import ServerProcess, fetch, make_keys, start_server, stop_cleanly

from lmcache_tiers.client import Client

_NEEDED = ("lmcache_plugin_fs", "lmcache_plugin_serde_fp8", "lmcache_plugin_serde_zstd")
_missing = [name for name in _NEEDED if importlib.util.find_spec(name) is None]
if _missing:
    pytest.skip(f"not installed: {', '.join(_missing)}", allow_module_level=True)

import torch  # noqa: E402 - only once the plugins (and torch with fp8) are known to be there

SHAPE = (4, 64, 128)  # 64 KiB of bf16 per chunk
COUNT = 4
#: fp8's largest finite value, its relative error bound and its smallest normal's exponent
FP8 = {"e4m3fn": (448.0, 2.0**-4, 2.0**-10), "e5m2": (57344.0, 2.0**-3, 2.0**-17)}


def _tensors(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tensors = []
    for index in range(COUNT):
        scale = torch.rand(SHAPE[-1], generator=generator) * 4 + 0.05  # channels of unlike range
        tensors.append((torch.randn(SHAPE, generator=generator) * scale * (index + 1)).to(torch.bfloat16))
    return tensors


def _assert_within_fp8_bound(
    original: torch.Tensor, restored: torch.Tensor, fmt: str, granularity: str
) -> None:
    """The bound of the options that wrote ``restored``'s frame: ``fmt``'s relative error
    (+ bf16 rounding) for normal values, scale * its subnormal step below them."""
    largest, relative, subnormal = FP8[fmt]
    x, y = original.double().reshape(-1, SHAPE[-1]), restored.double().reshape(-1, SHAPE[-1])
    amax = x.abs().amax(dim=0) if granularity == "channel" else x.abs().max()
    scale = amax / largest
    allowed = (relative + 2.0**-8 + relative * 2.0**-8) * x.abs() + scale * subnormal * (1 + 2.0**-8)
    within = bool(((y - x).abs() <= allowed * (1 + 1e-6)).all())
    assert within, f"a value is outside {fmt}/{granularity}'s bound"
    assert not torch.equal(x, y), "nothing was quantized"


def _server(log_dir: Path, root: Path, serde: list[dict[str, Any]]) -> ServerProcess:
    return start_server(log_dir, adapters=[{"type": "fs", "path": str(root), "serde": serde}])


def _store_through_l2(server: ServerProcess, tag: str, tensors: list[torch.Tensor]) -> None:
    with Client(server.url) as client:
        assert client.store(make_keys(tag, COUNT), tensors) == COUNT
        deadline = time.monotonic() + 60
        while client.status()["adapters"][0]["keys_stored"] < COUNT:
            assert time.monotonic() < deadline, "the store controller never wrote the chunks to L2"
            time.sleep(0.05)


def _read(server: ServerProcess, tag: str) -> list[torch.Tensor]:
    keys = make_keys(tag, COUNT)
    with Client(server.url) as client:
        hits = client.lookup(keys)
        with client.retrieve(keys[:hits]) as views:
            return [torch.frombuffer(bytearray(view), dtype=torch.bfloat16).reshape(SHAPE) for view in views]


def _stat(server: ServerProcess, name: str) -> float:
    assert server.http_url is not None
    _, _, text = fetch(server.http_url + "/metrics")
    sample = f'lmcache_tiers_adapter_stat{{adapter="0:fs",stat="{name}"}} '
    for line in text.splitlines():
        if line.startswith(sample):
            return float(line.split()[-1])
    return 0.0  # a stat an adapter never raised is not exported


FP8_OPTIONS = [("e4m3fn", "tensor"), ("e5m2", "channel"), ("e4m3fn", "channel"), ("e5m2", "tensor")]


# Each case reads both ways: the second server reads the first's frames, the third (the
# first's options again) the second's.  Between them every format and granularity writes
# a frame that the other format and granularity reads.
@pytest.mark.parametrize(
    ("written", "configured"),
    [(FP8_OPTIONS[0], FP8_OPTIONS[1]), (FP8_OPTIONS[2], FP8_OPTIONS[3])],
    ids=lambda options: "-".join(options),
)
def test_fp8_frames_read_by_the_options_that_wrote_them(
    tmp_path: Path, written: tuple[str, str], configured: tuple[str, str]
) -> None:
    root = tmp_path / "l2"
    before = [{"type": "fp8", "format": written[0], "granularity": written[1]}, {"type": "zstd"}]
    after = [{"type": "fp8", "format": configured[0], "granularity": configured[1]}, {"type": "zstd"}]
    old, new = _tensors(1), _tensors(2)
    first = _server(tmp_path / "first", root, before)
    try:
        _store_through_l2(first, "old", old)
    finally:
        stop_cleanly(first)
    second = _server(tmp_path / "second", root, after)
    try:
        restored = _read(second, "old")
        assert len(restored) == COUNT, "options inside a serde keep its records readable"
        for original, back in zip(old, restored, strict=True):
            _assert_within_fp8_bound(original, back, *written)
        assert _stat(second, "serde_chain_mismatch") == 0
        _store_through_l2(second, "new", new)
    finally:
        stop_cleanly(second)
    third = _server(tmp_path / "third", root, before)
    try:
        restored = _read(third, "new")
        assert len(restored) == COUNT
        for original, back in zip(new, restored, strict=True):
            _assert_within_fp8_bound(original, back, *configured)
    finally:
        stop_cleanly(third)


def test_zstd_records_keep_their_bytes_whatever_level_shuffle_or_element_size(tmp_path: Path) -> None:
    root = tmp_path / "l2"
    settings: list[dict[str, Any]] = [
        {"type": "zstd", "level": 1},
        {"type": "zstd", "level": 19, "shuffle": False},
        {"type": "zstd", "level": -5, "shuffle": True, "element_size": 4},
    ]
    tensors = {f"written-{index}": _tensors(10 + index) for index in range(len(settings))}
    for index, zstd in enumerate(settings):
        server = _server(tmp_path / f"run-{index}", root, [zstd])
        try:
            for tag, originals in tensors.items():
                if int(tag.rsplit("-", 1)[1]) < index:  # every record the earlier runs wrote
                    restored = _read(server, tag)
                    assert len(restored) == COUNT, f"{tag} is not readable under {zstd}"
                    assert all(torch.equal(a, b) for a, b in zip(originals, restored, strict=True)), tag
            _store_through_l2(server, f"written-{index}", tensors[f"written-{index}"])
        finally:
            stop_cleanly(server)
