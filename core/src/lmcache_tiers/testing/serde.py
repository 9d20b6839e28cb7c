"""Conformance suite of serde transforms, and :class:`Reversed`, a serde chain of the same
size for the tests of objects stored with another chain.

A serde plugin's tests subclass :class:`SerdeSuite`, name the component and declare what
its transform guarantees::

    class TestZstd(SerdeSuite):
        component_name = "zstd"
        capabilities = frozenset({LOSSLESS, DETECTS_CORRUPTION})

The suite builds the serde through the installed registry with ``make_config()`` and
drives it the way an adapter does: encode with the object's layout (which is also the
layout its record will state, ``record_layout``), decode with only the key and the L1 size
(``SerdeContext(key, size)``, as a store that keeps no record) and with the layout a record
states, through :func:`encode_chain` / :func:`decode_chain` when it tests chain positions.
A lossy serde overrides :meth:`SerdeSuite.assert_round_trip` with its error bound;
everything else is the same for every serde.

What every serde must do, capability or not: decode what it encoded back to exactly the
L1 size at any position of a chain, with no layout on decode; leave its input buffers
untouched; accept read-only and writable buffers; round-trip empty and large objects;
work from several threads at once; decode what another instance of it (a restarted
server's) encoded; keep every output within ``max_encoded_size`` when it
declares one; and answer a truncated, extended or foreign input with an exception or an
output of the wrong size (both of which the adapter turns into a counted miss), never a
crash or an object of the right size made of wrong bytes.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import msgspec
import numpy as np
import pytest

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.registry import Kind
from lmcache_tiers.serde import Serde, SerdeContext, decode_chain, encode_chain
from lmcache_tiers.testing.base import ComponentSuite, capability, requires

#: decode(encode(x)) is x, bit for bit, for every object
LOSSLESS = capability("lossless")
#: any single flipped byte of an encoding makes decode raise (a checksum or a MAC)
DETECTS_CORRUPTION = capability("detects_corruption")
#: an encoding decodes only under the object key it was encoded for (associated data)
BINDS_KEY = capability("binds_key")

#: shape of the KV-shaped tensors the suite feeds serdes: [K/V, layers, tokens, hidden]
KV_SHAPE = (2, 4, 256, 512)
#: the large object: 32 MiB of bf16 KV
LARGE_KV_SHAPE = (2, 8, 256, 4096)


class Reversed:
    """A serde that stores an object's bytes back to front: another serde chain than none,
    of the same size, whose objects decoded by any other chain are wrong bytes."""

    name = "reversed"

    def encode(self, data: memoryview, context: SerdeContext) -> bytes:
        return bytes(data)[::-1]

    def decode(self, data: memoryview, context: SerdeContext) -> bytes:
        return bytes(data)[::-1]


def kv_layout(shape: Sequence[int], dtype: str = "bfloat16") -> str:
    """Layout string of a tensor (see :mod:`lmcache_tiers.layout`)."""
    return f"{dtype}[{','.join(str(dim) for dim in shape)}]"


def kv_like_float32(shape: Sequence[int], seed: int = 0) -> np.ndarray[Any, np.dtype[np.float32]]:
    """Float32 values shaped like one KV chunk ``[2, layers, tokens, hidden]``.

    Real KV caches are roughly normal per channel, with channel scales that vary over
    an order of magnitude and a few outlier channels in K (a known property of attention
    keys).  No model weights are available to this project, so this is the synthetic
    stand-in every serde measurement and test uses; it is deterministic per seed.
    """
    shape = tuple(int(dim) for dim in shape)
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(shape, dtype=np.float32)
    if len(shape) >= 2:
        channels = shape[-1]
        scale_shape = (1,) * (len(shape) - 1) + (channels,)
        values *= rng.lognormal(0.0, 0.6, size=scale_shape).astype(np.float32)
        outliers = rng.choice(channels, max(1, channels // 50), replace=False)
        values[0, ..., outliers] *= 12.0
    return values


def float32_to_bfloat16_bytes(values: np.ndarray[Any, np.dtype[np.float32]]) -> bytes:
    """Round float32 values to bfloat16 (nearest, ties to even) and return their bytes."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype("<u2").tobytes()


def kv_like_bf16(shape: Sequence[int] = KV_SHAPE, seed: int = 0) -> bytes:
    """Bytes of a bf16 KV-shaped tensor (see :func:`kv_like_float32`)."""
    return float32_to_bfloat16_bytes(kv_like_float32(shape, seed))


def random_bytes(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def suite_key(index: int = 0, *, salt: str = "", model: str = "suite-model") -> ObjectKey:
    return ObjectKey(model, 0, index.to_bytes(32, "big"), 0, salt)


def sample_objects() -> list[tuple[str, bytes, str]]:
    """(name, bytes, layout) of the objects every test round-trips."""
    special = np.array([0.0, -0.0, 1.5, np.inf, -np.inf, np.nan, 3e38, -1e-40] * 16, dtype=np.float32)
    return [
        ("bf16 kv", kv_like_bf16(KV_SHAPE, 1), kv_layout(KV_SHAPE)),
        ("bf16 kv without layout", kv_like_bf16(KV_SHAPE, 2), ""),
        (
            "float16 odd shape",
            np.random.default_rng(3).standard_normal((3, 7, 5)).astype("<f2").tobytes(),
            kv_layout((3, 7, 5), "float16"),
        ),
        ("float32 zeros", bytes(1 << 20), kv_layout((256, 1024), "float32")),
        ("float32 inf nan", special.tobytes(), kv_layout((8, 16), "float32")),
        ("uint8 tensor", random_bytes(1 << 16, 4), kv_layout((256, 256), "uint8")),
        ("random bytes", random_bytes(300_001, 5), ""),
        ("one byte", b"\x7f", ""),
        ("one bf16", b"\x80\x3f", kv_layout((1,))),
    ]


def _raises(call: Callable[..., object], *args: Any) -> bool:
    """True when ``call(*args)`` raises an Exception (the serde chooses which)."""
    try:
        call(*args)
    except Exception:
        return True
    return False


class _FramingSerde:
    """A test stage that changes sizes: a length prefix and inverted bytes.

    Placed before or after the serde under test, it shows the serde keeps what it needs
    in its own encoding (``context.size`` is the L1 size, not its input's size).
    """

    name = "suite-framing"

    def encode(self, data: memoryview, context: SerdeContext) -> bytes:
        return len(data).to_bytes(8, "little") + bytes(b ^ 0xFF for b in bytes(data[:64])) + bytes(data[64:])

    def decode(self, data: memoryview, context: SerdeContext) -> bytes:
        length = int.from_bytes(data[:8], "little")
        if length != len(data) - 8:
            raise ValueError("framing length mismatch")
        body = bytes(data[8:])
        return bytes(b ^ 0xFF for b in body[:64]) + body[64:]


class SerdeSuite(ComponentSuite):
    """What every serde must do; see the module docstring."""

    kind: ClassVar[Kind] = Kind.SERDE
    #: threads and objects per thread of the concurrency test
    concurrency: ClassVar[tuple[int, int]] = (4, 6)

    # -- hooks ------------------------------------------------------------------------------

    def make_config(self) -> msgspec.Struct:
        """The config the serde is built with; the Struct's defaults unless overridden."""
        config_type: Any = self.registered_component().config
        built: msgspec.Struct = config_type()
        return built

    def make_serde(self) -> Serde:
        # Every serde of one test is built from one config, as a restarted server reads the
        # same config file: a make_config() drawing a new key at each call must not fail a
        # serde whose instances share their key through the config.
        config = self.__dict__.get("_suite_config")
        if config is None:
            config = self._suite_config = self.make_config()
        built = self.registered_component().create(config)
        assert isinstance(built, Serde), f"{type(built).__name__} lacks name/encode/decode"
        return built

    def assert_round_trip(self, original: bytes, decoded: bytes, layout: str) -> None:
        """Check a decoded object against the original; a lossy serde overrides this."""
        assert len(decoded) == len(original)
        assert decoded == original, f"decoded bytes differ (layout {layout!r})"

    # -- helpers ----------------------------------------------------------------------------

    @pytest.fixture
    def serde(self) -> Serde:
        return self.make_serde()

    @staticmethod
    def encode(
        serde: Serde, data: bytes | bytearray | memoryview, layout: str = "", key: ObjectKey | None = None
    ) -> bytes:
        view = memoryview(data).cast("B")
        # As the adapter encodes: the layout is also what the object's record will state.
        out = serde.encode(view, SerdeContext(key or suite_key(), view.nbytes, layout, layout))
        return bytes(memoryview(out).cast("B"))

    @staticmethod
    def decode(
        serde: Serde, encoded: bytes | bytearray | memoryview, size: int, key: ObjectKey | None = None
    ) -> bytes:
        out = serde.decode(memoryview(encoded).cast("B"), SerdeContext(key or suite_key(), size))
        return bytes(memoryview(out).cast("B"))

    def refuses(self, serde: Serde, encoded: bytes, size: int, key: ObjectKey | None = None) -> bool:
        """True when decoding ``encoded`` raises or yields other than ``size`` bytes."""
        try:
            decoded = self.decode(serde, encoded, size, key)
        except Exception:
            return True
        return len(decoded) != size

    # -- the suite --------------------------------------------------------------------------

    def test_name_can_be_recorded(self, serde: Serde) -> None:
        assert isinstance(serde.name, str) and serde.name
        assert "," not in serde.name, "record headers join chain names with ','"
        assert serde.name == self.make_serde().name, "the name must not vary between instances"

    def test_round_trip(self, serde: Serde) -> None:
        for name, data, layout in sample_objects():
            encoded = self.encode(serde, data, layout)
            decoded = self.decode(serde, encoded, len(data))
            assert len(decoded) == len(data), name
            self.assert_round_trip(data, decoded, layout)

    def test_empty_objects(self, serde: Serde) -> None:
        for layout in ("", "bfloat16[0]", "float32[4,0,16]"):
            encoded = self.encode(serde, b"", layout)
            assert self.decode(serde, encoded, 0) == b""

    def test_large_object(self, serde: Serde) -> None:
        data = kv_like_bf16(LARGE_KV_SHAPE, 7)
        layout = kv_layout(LARGE_KV_SHAPE)
        encoded = self.encode(serde, data, layout)
        bound = getattr(serde, "max_encoded_size", None)
        if bound is not None:
            assert len(encoded) <= bound(len(data))
        self.assert_round_trip(data, self.decode(serde, encoded, len(data)), layout)

    def test_inputs_are_left_untouched_and_may_be_read_only(self, serde: Serde) -> None:
        data = kv_like_bf16(KV_SHAPE, 8)
        layout = kv_layout(KV_SHAPE)
        writable = bytearray(data)
        from_writable = self.encode(serde, writable, layout)
        from_read_only = self.encode(serde, data, layout)
        assert bytes(writable) == data, "encode modified its input"
        float32 = ("float32 kv", kv_like_float32((64, 128), 8).tobytes(), kv_layout((64, 128), "float32"))
        for name, sample, sample_layout in [*sample_objects(), float32]:
            # Every dtype: float32 is a codec's own working type (a conversion to it may
            # return the input itself), the others are not.
            copy = bytearray(sample)
            self.encode(serde, copy, sample_layout)
            assert bytes(copy) == sample, f"encode modified its input ({name})"
        for encoded in (from_writable, from_read_only):
            stored = bytearray(encoded)
            self.assert_round_trip(data, self.decode(serde, stored, len(data)), layout)
            assert bytes(stored) == encoded, "decode modified its input"
            self.assert_round_trip(data, self.decode(serde, encoded, len(data)), layout)

    def test_outputs_are_byte_buffers(self, serde: Serde) -> None:
        data = kv_like_bf16(KV_SHAPE, 9)
        context = SerdeContext(suite_key(), len(data), kv_layout(KV_SHAPE))
        encoded = serde.encode(memoryview(data), context)
        assert isinstance(encoded, bytes | memoryview)
        assert memoryview(encoded).c_contiguous
        decoded = serde.decode(memoryview(encoded).cast("B"), SerdeContext(suite_key(), len(data)))
        assert isinstance(decoded, bytes | memoryview)
        assert memoryview(decoded).c_contiguous
        assert memoryview(decoded).nbytes == len(data)

    def test_another_instance_decodes_what_one_encoded(self, serde: Serde) -> None:
        """A restarted server decodes what the one before it stored: everything decode
        needs is in the encoding or the config, nothing in the encoding instance."""
        encoded = [(self.encode(serde, data, layout), data, layout) for _, data, layout in sample_objects()]
        restarted = self.make_serde()
        for encoding, data, layout in reversed(encoded):
            self.assert_round_trip(data, self.decode(restarted, encoding, len(data)), layout)

    def test_works_at_every_chain_position(self, serde: Serde) -> None:
        framing = _FramingSerde()
        for chain in ([framing, serde], [serde, framing], [serde, self.make_serde()]):
            for name, data, layout in sample_objects():
                context = SerdeContext(suite_key(), len(data), layout, layout)
                encoded = bytes(encode_chain(chain, memoryview(data), context))
                decoded = decode_chain(chain, memoryview(encoded), SerdeContext(suite_key(), len(data)))
                assert decoded.nbytes == len(data), f"{name} through {[s.name for s in chain]}"
                self.assert_round_trip(data, bytes(decoded), layout)

    def test_decodes_with_the_layout_its_record_states(self, serde: Serde) -> None:
        """A persistent store's record states the object's layout and every stage decodes
        with it (``record_layout``); only the first stage encoded with it as ``layout``."""
        framing = _FramingSerde()
        for chain in ([serde], [framing, serde], [serde, framing]):
            for name, data, layout in sample_objects():
                encoded = bytes(
                    encode_chain(
                        chain, memoryview(data), SerdeContext(suite_key(), len(data), layout, layout)
                    )
                )
                stated = SerdeContext(suite_key(), len(data), record_layout=layout)
                decoded = decode_chain(chain, memoryview(encoded), stated)
                assert decoded.nbytes == len(data), f"{name} through {[s.name for s in chain]}"
                self.assert_round_trip(data, bytes(decoded), layout)

    def test_chain_decodes_last_to_first(self, serde: Serde) -> None:
        """Decoding in encoding order instead is refused, never silently wrong."""
        framing = _FramingSerde()
        data = kv_like_bf16(KV_SHAPE, 10)
        context = SerdeContext(suite_key(), len(data), kv_layout(KV_SHAPE))
        encoded = encode_chain([serde, framing], memoryview(data), context)
        decode_context = SerdeContext(suite_key(), len(data))
        try:
            inner = memoryview(serde.decode(encoded, decode_context)).cast("B")
            wrong_order = bytes(memoryview(framing.decode(inner, decode_context)).cast("B"))
        except Exception:
            return  # refused: what the adapter turns into a miss
        assert len(wrong_order) != len(data) or wrong_order == data, "wrong order decoded to wrong bytes"

    def test_max_encoded_size_is_respected(self, serde: Serde) -> None:
        bound = getattr(serde, "max_encoded_size", None)
        if bound is None:
            pytest.skip(f"{self.component_name} declares no max_encoded_size")
        for size in (0, 1, 2, 17, 4096, 1 << 20):
            assert bound(size) >= 0
        for name, data, layout in [*sample_objects(), ("empty", b"", "")]:
            encoded = self.encode(serde, data, layout)
            assert len(encoded) <= bound(len(data)), f"{name}: {len(encoded)} > bound {bound(len(data))}"

    def test_truncated_extended_and_foreign_input_is_refused(self, serde: Serde) -> None:
        for name, data, layout in sample_objects():
            encoded = self.encode(serde, data, layout)
            for cut in {0, 1, len(encoded) // 2, len(encoded) - 1}:
                if cut < len(encoded):
                    assert self.refuses(serde, encoded[:cut], len(data)), f"{name}: cut to {cut} bytes"
            assert self.refuses(serde, encoded + b"\0", len(data)), f"{name}: one byte appended"
            # Same length as the real encoding, but not one: must not decode to the object size.
            assert self.refuses(serde, random_bytes(len(encoded), 11), len(data)), f"{name}: random input"
        raw = kv_like_bf16(KV_SHAPE, 12)
        assert self.refuses(serde, raw, len(raw) // 3), "a raw object is not an encoding"

    def test_flipped_bytes_never_crash(self, serde: Serde) -> None:
        data = kv_like_bf16(KV_SHAPE, 13)
        encoded = self.encode(serde, data, kv_layout(KV_SHAPE))
        for position in self._flip_positions(len(encoded)):
            damaged = bytearray(encoded)
            damaged[position] ^= 0x5A
            try:
                decoded = self.decode(serde, damaged, len(data))
            except Exception:
                continue
            assert isinstance(decoded, bytes)

    @requires(DETECTS_CORRUPTION)
    def test_every_flipped_byte_is_detected(self, serde: Serde) -> None:
        for name, data, layout in sample_objects():
            encoded = self.encode(serde, data, layout)
            for position in self._flip_positions(len(encoded)):
                damaged = bytearray(encoded)
                damaged[position] ^= 0x01
                assert _raises(self.decode, serde, damaged, len(data)), (
                    f"{name}: flipped byte {position} of {len(encoded)} went unnoticed"
                )

    @requires(LOSSLESS)
    def test_lossless_for_every_object(self, serde: Serde) -> None:
        for name, data, layout in sample_objects():
            assert self.decode(serde, self.encode(serde, data, layout), len(data)) == data, name

    @requires(BINDS_KEY)
    def test_decodes_only_under_its_own_key(self, serde: Serde) -> None:
        data = kv_like_bf16(KV_SHAPE, 14)
        key = suite_key(1, salt="tenant-a")
        encoded = self.encode(serde, data, kv_layout(KV_SHAPE), key)
        self.assert_round_trip(data, self.decode(serde, encoded, len(data), key), kv_layout(KV_SHAPE))
        others = [
            suite_key(2, salt="tenant-a"),
            suite_key(1, salt="tenant-b"),
            suite_key(1, salt="tenant-a", model="other-model"),
            ObjectKey(key.model_name, 1, key.chunk_hash, 0, key.cache_salt),
            ObjectKey(key.model_name, 0, key.chunk_hash, 1, key.cache_salt),
        ]
        for other in others:
            assert _raises(self.decode, serde, encoded, len(data), other), f"decoded under {other}"

    def test_concurrent_use(self, serde: Serde) -> None:
        threads, per_thread = self.concurrency
        layout = kv_layout(KV_SHAPE)
        start = threading.Barrier(threads)

        def worker(thread: int) -> int:
            start.wait()
            checked = 0
            for index in range(per_thread):
                seed = 1000 + thread * per_thread + index
                data = kv_like_bf16(KV_SHAPE, seed) if index % 2 == 0 else random_bytes(200_003, seed)
                object_layout = layout if index % 2 == 0 else ""
                key = suite_key(seed)
                decoded = self.decode(serde, self.encode(serde, data, object_layout, key), len(data), key)
                self.assert_round_trip(data, decoded, object_layout)
                checked += 1
            return checked

        with ThreadPoolExecutor(threads) as pool:
            assert sum(pool.map(worker, range(threads))) == threads * per_thread

    def test_stats_are_counters(self, serde: Serde) -> None:
        stats = getattr(serde, "stats", None)
        if stats is None:
            pytest.skip(f"{self.component_name} exposes no stats()")
        data = kv_like_bf16(KV_SHAPE, 15)
        self.decode(serde, self.encode(serde, data, kv_layout(KV_SHAPE)), len(data))
        counters = stats()
        assert isinstance(counters, dict) and counters
        assert all(isinstance(k, str) and isinstance(v, int) and v >= 0 for k, v in counters.items())
        assert sum(counters.values()) > 0, "an encode and a decode left every counter at zero"

    @staticmethod
    def _flip_positions(length: int) -> list[int]:
        """Every byte of the first 96 and last 48, and 48 spread over the rest."""
        rng = random.Random(length)
        edges = set(range(min(96, length))) | set(range(max(0, length - 48), length))
        middle = rng.sample(range(length), min(48, length))
        return sorted(edges | set(middle))
