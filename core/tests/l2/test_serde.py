"""Serde chains: building from specs, applying in order."""

from __future__ import annotations

import zlib

import pytest

from lmcache_tiers.config import ComponentConfig, SerdeSpec
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.registry import ComponentRegistry, EmptyConfig, Kind
from lmcache_tiers.serde import (
    IdentitySerde,
    Serde,
    SerdeContext,
    build_serde_chain,
    decode_chain,
    encode_chain,
    serde_names,
)

KEY = ObjectKey("serde-model", 0, b"\x01" * 32)


class Zlib:
    name = "zlib"

    def encode(self, data: memoryview, context: SerdeContext) -> bytes:
        return zlib.compress(data)

    def decode(self, data: memoryview, context: SerdeContext) -> bytes:
        return zlib.decompress(data)


class Prefix:
    """Adds a tag, so the order of a chain is visible."""

    def __init__(self, tag: bytes) -> None:
        self.name = f"prefix-{tag.decode()}"
        self.tag = tag

    def encode(self, data: memoryview, context: SerdeContext) -> bytes:
        return self.tag + bytes(data)

    def decode(self, data: memoryview, context: SerdeContext) -> memoryview:
        assert bytes(data[: len(self.tag)]) == self.tag, "decoded in the wrong order"
        return data[len(self.tag) :]


class TagConfig(ComponentConfig):
    tag: str = "a"


def registry() -> ComponentRegistry:
    reg = ComponentRegistry()
    serdes = reg.for_plugin(Kind.SERDE, "test")
    serdes.add("zlib", lambda config: Zlib())
    serdes.add("prefix", lambda config: Prefix(config.tag.encode()), TagConfig)
    serdes.add("broken", lambda config: object())
    return reg


def test_identity_is_a_serde_and_changes_nothing() -> None:
    identity = IdentitySerde()
    assert isinstance(identity, Serde)
    data = memoryview(b"abc")
    context = SerdeContext(KEY, 3)
    assert identity.encode(data, context) is data
    assert identity.decode(data, context) is data


def test_build_chain_in_order_and_round_trip() -> None:
    specs = [
        SerdeSpec(type="prefix", config=TagConfig(tag="x")),
        SerdeSpec(type="ZLIB", config=EmptyConfig()),
        SerdeSpec(type="prefix", config=TagConfig(tag="y")),
    ]
    chain = build_serde_chain(specs, registry())
    assert serde_names(chain) == ("prefix-x", "zlib", "prefix-y")
    original = memoryview(b"hello world" * 100)
    context = SerdeContext(KEY, original.nbytes)
    encoded = encode_chain(chain, original, context)
    assert bytes(encoded[:1]) == b"y"
    assert bytes(decode_chain(chain, encoded, context)) == bytes(original)


class SeesLayout:
    """Records the layout each encode was given."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.layouts: list[str] = []

    def encode(self, data: memoryview, context: SerdeContext) -> bytes:
        self.layouts.append(context.layout)
        return b"+" + bytes(data)  # changes the bytes: no layout describes them any more

    def decode(self, data: memoryview, context: SerdeContext) -> memoryview:
        return data[1:]


def test_only_the_first_stage_is_given_the_layout() -> None:
    from lmcache_tiers.l2.codec import SerdeChain

    layout = "uint8[4,4]"
    data = memoryview(bytes(range(16)))
    first, second = SeesLayout("first"), SeesLayout("second")
    encode_chain([first, second], data, SerdeContext(KEY, data.nbytes, layout))
    staged = SerdeChain([first, second]).encode(KEY, data, layout)
    staged.release()
    assert first.layouts == [layout, layout]
    assert second.layouts == ["", ""]


def test_empty_chain_is_identity() -> None:
    assert build_serde_chain([], registry()) == []
    data = memoryview(b"xyz")
    assert bytes(encode_chain([], data, SerdeContext(KEY, 3))) == b"xyz"
    assert serde_names([IdentitySerde()]) == ()


def test_unknown_and_broken_serdes_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="did you mean 'zlib'"):
        build_serde_chain([SerdeSpec(type="zlip", config=EmptyConfig())], registry())
    with pytest.raises(ConfigError, match="lacks name/encode/decode"):
        build_serde_chain([SerdeSpec(type="broken", config=EmptyConfig())], registry())


def test_serde_names_that_records_cannot_tell_apart_are_config_errors() -> None:
    """Record headers join chain names with ','; ["prefix-a,zlib"] must not pass for
    ["prefix-a", "zlib"]."""
    with pytest.raises(ConfigError, match="without ','"):
        build_serde_chain([SerdeSpec(type="prefix", config=TagConfig(tag="a,zlib"))], registry())
    unnamed = Zlib()
    unnamed.name = ""
    reg = registry()
    reg.for_plugin(Kind.SERDE, "test").add("unnamed", lambda config: unnamed)
    with pytest.raises(ConfigError, match="non-empty"):
        build_serde_chain([SerdeSpec(type="unnamed", config=EmptyConfig())], reg)
