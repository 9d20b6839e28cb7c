"""A key's rank and object group are ints, never a bool or a float equal to one.

``True`` and ``1.0`` equal ``1`` and passed the bounds, so such a key was built and equal
to the one of rank 1, but it encodes as a bool or a float, which the server refuses as
MALFORMED: the key type refuses them when it is built, whichever way it is."""

from __future__ import annotations

import enum

import msgspec
import pytest

from lmcache_tiers.errors import KeyValidationError
from lmcache_tiers.keys import ObjectKey, prefix_keys

ODD_NUMBERS = [True, False, 1.0, 0.0]


def _key(kv_rank: object = 1, object_group: object = 0, model_name: str = "m") -> ObjectKey:
    return ObjectKey(model_name, kv_rank, b"h", object_group, "s")  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["kv_rank", "object_group"])
@pytest.mark.parametrize("value", ODD_NUMBERS, ids=repr)
def test_a_bool_or_float_is_refused_with_names_checked_before(field: str, value: object) -> None:
    """The usual path: the names passed before, so only the numbers are looked at."""
    _key()
    with pytest.raises(KeyValidationError, match=f"{field} must be an int, got {type(value).__name__}"):
        _key(**{field: value})


@pytest.mark.parametrize("field", ["kv_rank", "object_group"])
@pytest.mark.parametrize("value", ODD_NUMBERS, ids=repr)
def test_a_bool_or_float_is_refused_with_names_never_seen(field: str, value: object) -> None:
    """The path that checks every field, names first."""
    with pytest.raises(KeyValidationError, match=f"{field} must be an int"):
        _key(**{field: value}, model_name=f"never-seen-{field}-{value!r}")


@pytest.mark.parametrize("value", [True, 1.0], ids=repr)
def test_other_ways_of_building_a_key_refuse_them_too(value: object) -> None:
    with pytest.raises(KeyValidationError, match="kv_rank must be an int"):
        msgspec.structs.replace(_key(), kv_rank=value)
    with pytest.raises(KeyValidationError, match="object_group must be an int"):
        prefix_keys([0] * 4, 4, model_name="m", object_group=value)  # type: ignore[arg-type]
    with pytest.raises(KeyValidationError):
        ObjectKey.from_bytes(msgspec.msgpack.encode(["m", value, b"h", 0, "s"]))


def test_an_int_enum_is_an_int_and_encodes_as_one() -> None:
    class Rank(enum.IntEnum):
        FIRST = 1

    key = _key(Rank.FIRST)
    assert key == _key(1) and key.to_bytes() == _key(1).to_bytes()
