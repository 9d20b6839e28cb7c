"""The SerdeSuite fails serdes that break the contract (it is not a suite that always passes)."""

from __future__ import annotations

import os
from typing import Any

import msgspec
import numpy as np
import pytest

from lmcache_tiers.serde import IdentitySerde, SerdeContext
from lmcache_tiers.testing.serde import SerdeSuite


class _LengthPrefixed:
    """Correct framing: an 8-byte length, then the bytes."""

    name = "suite-probe"

    def encode(self, data: memoryview, context: SerdeContext) -> bytes:
        return len(data).to_bytes(8, "little") + bytes(data)

    def decode(self, data: memoryview, context: SerdeContext) -> bytes:
        if len(data) < 8 or int.from_bytes(data[:8], "little") != len(data) - 8:
            raise ValueError("bad frame")
        return bytes(data[8:])


class _IgnoresTrailingBytes(_LengthPrefixed):
    def decode(self, data: memoryview, context: SerdeContext) -> bytes:
        length = int.from_bytes(data[:8], "little")
        if len(data) < 8 + length:
            raise ValueError("short frame")
        return bytes(data[8 : 8 + length])


class _UnderstatesItsBound(_LengthPrefixed):
    def max_encoded_size(self, size: int) -> int:
        return size


class _DropsTheLastByte(_LengthPrefixed):
    def encode(self, data: memoryview, context: SerdeContext) -> bytes:
        body = bytes(data[:-1]) + b"\0" if len(data) else b""
        return len(body).to_bytes(8, "little") + body


class _ModifiesItsInput(_LengthPrefixed):
    def encode(self, data: memoryview, context: SerdeContext) -> bytes:
        out = super().encode(data, context)
        if not data.readonly and len(data):
            data[0] ^= 0xFF
        return out


class _PadOfItsOwn(_LengthPrefixed):
    """XORs objects with a pad each instance draws at random and keeps only in memory:
    consistent within an instance, garbage after a restart."""

    def __init__(self) -> None:
        self.pad = os.urandom(256)

    def _xor(self, data: bytes) -> bytes:
        pad = np.frombuffer(self.pad * (len(data) // 256 + 1), dtype=np.uint8)[: len(data)]
        return (np.frombuffer(data, dtype=np.uint8) ^ pad).tobytes()

    def encode(self, data: memoryview, context: SerdeContext) -> bytes:
        return super().encode(memoryview(self._xor(bytes(data))), context)

    def decode(self, data: memoryview, context: SerdeContext) -> bytes:
        return self._xor(super().decode(data, context))


class _BindsTheStatedLayoutAsGiven(_LengthPrefixed):
    """Binds ``record_layout`` into its frame and wants the same one back: right when the
    record states a layout, a miss for every object of a store that keeps no record
    (decoded with none)."""

    def encode(self, data: memoryview, context: SerdeContext) -> bytes:
        stated = context.record_layout.encode()
        return len(stated).to_bytes(2, "little") + stated + super().encode(data, context)

    def decode(self, data: memoryview, context: SerdeContext) -> bytes:
        length = int.from_bytes(data[:2], "little")
        if bytes(data[2 : 2 + length]) != context.record_layout.encode():
            raise ValueError("another layout")
        return super().decode(data[2 + length :], context)


class _ChecksItsOwnLayoutAgainstTheStated(_LengthPrefixed):
    """Keeps ``context.layout`` (known to the first stage only) and compares it with the
    layout a record states: a miss for every object when it is not the first stage."""

    def encode(self, data: memoryview, context: SerdeContext) -> bytes:
        own = context.layout.encode()
        return len(own).to_bytes(2, "little") + own + super().encode(data, context)

    def decode(self, data: memoryview, context: SerdeContext) -> bytes:
        length = int.from_bytes(data[:2], "little")
        if context.record_layout and bytes(data[2 : 2 + length]) != context.record_layout.encode():
            raise ValueError("another layout")
        return super().decode(data[2 + length :], context)


def _suite_for(serde: Any) -> SerdeSuite:
    class Probe(SerdeSuite):
        component_name = "probe"

        def make_serde(self) -> Any:
            return type(serde)()  # a new instance, as the registry builds one

    return Probe()


def test_a_correct_serde_passes() -> None:
    suite = _suite_for(_LengthPrefixed())
    serde = _LengthPrefixed()
    suite.test_round_trip(serde)
    suite.test_truncated_extended_and_foreign_input_is_refused(serde)
    suite.test_inputs_are_left_untouched_and_may_be_read_only(serde)
    suite.test_works_at_every_chain_position(serde)
    suite.test_chain_decodes_last_to_first(serde)
    suite.test_another_instance_decodes_what_one_encoded(serde)
    suite.test_decodes_with_the_layout_its_record_states(serde)


@pytest.mark.parametrize(
    ("serde", "test"),
    [
        (IdentitySerde(), "test_truncated_extended_and_foreign_input_is_refused"),
        (_IgnoresTrailingBytes(), "test_truncated_extended_and_foreign_input_is_refused"),
        (_UnderstatesItsBound(), "test_max_encoded_size_is_respected"),
        (_DropsTheLastByte(), "test_round_trip"),
        (_DropsTheLastByte(), "test_large_object"),
        (_ModifiesItsInput(), "test_inputs_are_left_untouched_and_may_be_read_only"),
        (_PadOfItsOwn(), "test_another_instance_decodes_what_one_encoded"),
        (_LengthPrefixed(), "test_every_flipped_byte_is_detected"),
        (_LengthPrefixed(), "test_decodes_only_under_its_own_key"),
    ],
)
def test_a_broken_serde_fails(serde: Any, test: str) -> None:
    suite = _suite_for(serde)
    with pytest.raises(AssertionError):
        getattr(suite, test)(serde)


@pytest.mark.parametrize(
    ("serde", "test"),
    [
        (_BindsTheStatedLayoutAsGiven(), "test_round_trip"),
        (_ChecksItsOwnLayoutAgainstTheStated(), "test_decodes_with_the_layout_its_record_states"),
    ],
)
def test_a_serde_refusing_what_an_adapter_decodes_fails(serde: Any, test: str) -> None:
    # Refused by raising: the adapter makes that a miss, of every object it stored.
    suite = _suite_for(serde)
    with pytest.raises(ValueError, match="another layout"):
        getattr(suite, test)(serde)


class _KeyConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pad: bytes = b"\x5a" * 256


class _PadFromItsConfig(_PadOfItsOwn):
    """The pad comes from the config: every instance of one config decodes what another
    encoded, as a restarted server reading the same config file does."""

    def __init__(self, config: _KeyConfig) -> None:
        self.pad = config.pad


class _Registered:
    config = _KeyConfig

    def create(self, config: _KeyConfig) -> _PadFromItsConfig:
        return _PadFromItsConfig(config)


class _FreshKeyEachConfig(SerdeSuite):
    """A suite whose config draws a new key each time it is made (a test with no key file
    to share): every serde of one test must be built from the same config."""

    component_name = "probe"

    def registered_component(self) -> Any:
        return _Registered()

    def make_config(self) -> _KeyConfig:
        return _KeyConfig(pad=os.urandom(256))


def test_another_instance_is_built_from_the_same_config() -> None:
    suite = _FreshKeyEachConfig()
    suite.test_another_instance_decodes_what_one_encoded(suite.make_serde())
