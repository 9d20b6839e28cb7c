"""The key <-> object name codec: safe, canonical, round-tripping names."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_tiers.errors import KeyValidationError
from lmcache_tiers.keycodec import (
    NAME_MAX,
    is_digest_name,
    key_to_name,
    name_to_key,
    printable,
)
from lmcache_tiers.keys import MAX_CACHE_SALT_LEN, MAX_MODEL_NAME_LEN, ObjectKey

_names = st.text(
    alphabet=st.characters(blacklist_characters="/\\@\x00", blacklist_categories=("Cs",)),
    max_size=MAX_MODEL_NAME_LEN,
)


def valid_key(model: str, salt: str, rank: int, group: int, digest: bytes) -> ObjectKey | None:
    try:
        return ObjectKey(model, rank, digest, group, salt)
    except KeyValidationError:
        return None


@settings(max_examples=400, deadline=None)
@given(
    model=_names.filter(bool),
    salt=_names.map(lambda s: s[:MAX_CACHE_SALT_LEN]),
    rank=st.integers(0, 2**32 - 1),
    group=st.integers(0, 65535),
    digest=st.binary(min_size=1, max_size=64),
)
def test_every_valid_key_round_trips_through_a_safe_name(
    model: str, salt: str, rank: int, group: int, digest: bytes
) -> None:
    key = valid_key(model, salt, rank, group, digest)
    if key is None:
        return
    name = key_to_name(key)
    assert len(name.encode()) <= NAME_MAX
    assert "/" not in name and "\x00" not in name and not name.startswith(".")
    assert name not in (".", "..")
    assert name.isascii() and name.isprintable()
    if is_digest_name(name):
        assert name_to_key(name) is None  # its key lives in the record header
    else:
        assert name_to_key(name) == key


def test_plain_names_are_the_file_stem() -> None:
    key = ObjectKey("Qwen2.5-7B_instruct", 0x01000100, bytes(range(32)), 3, "tenant-a")
    assert key_to_name(key) == key.file_stem()
    assert name_to_key(key.file_stem()) == key


@pytest.mark.parametrize("model", [".hidden", "..x", "a b", "line\nbreak", "ümlaut", "tab\there", "%41"])
def test_awkward_model_names_are_escaped(model: str) -> None:
    key = ObjectKey(model, 1, b"\xab" * 16, 0, ".salt")
    name = key_to_name(key)
    assert not name.startswith(".") and name.isascii() and "\n" not in name
    assert name_to_key(name) == key


def test_long_unicode_names_get_digest_names() -> None:
    key = ObjectKey("模" * MAX_MODEL_NAME_LEN, 0, os.urandom(32), 0, "盐" * MAX_CACHE_SALT_LEN)
    name = key_to_name(key)
    assert is_digest_name(name) and len(name) == 33
    assert key_to_name(key) == name  # deterministic
    assert key_to_name(key, max_len=8000) != name  # a roomier namespace keeps it readable


@pytest.mark.parametrize(
    "name",
    [
        "m@0x00000001@0@ab",  # fine, for contrast below
        "m@0x1@0@ab",
        "m@0x00000001@00@ab",
        "m@0x00000001@0@abc",
        "m@0x00000001@0@ab@",
        ".m@0x00000001@0@ab",
        "%6D@0x00000001@0@ab",  # escapes a safe byte: not canonical
        "m%2@0x00000001@0@ab",
        "notes.txt",
        "m%ED%A0%80@0x00000001@0@ab",  # a lone surrogate: no key can hold it
        "m@0x00000001@0@ab@%ED%BF%BF",
        "m%C0%AE@0x00000001@0@ab",  # overlong UTF-8
    ],
)
def test_foreign_or_non_canonical_names_are_not_keys(name: str) -> None:
    decoded = name_to_key(name)
    if name == "m@0x00000001@0@ab":
        assert decoded == ObjectKey("m", 1, b"\xab")
    else:
        assert decoded is None


def test_printable_escapes_control_characters_for_log_lines() -> None:
    assert printable("model\n2026-12-01 INFO forged") == "model\\n2026-12-01 INFO forged"
    assert printable("plain") == "plain"
    assert len(printable("x" * 500)) == 120


def test_only_whole_digest_names_are_digest_names() -> None:
    digest = key_to_name(ObjectKey("模" * MAX_MODEL_NAME_LEN, 0, b"\x01"))
    assert is_digest_name(digest)
    # ``$`` also matches before a final newline: a foreign "~<hex>\n" is no name of ours
    # (a file store judges digest-named files by their header, and removes mismatches).
    for foreign in (digest + "\n", digest + "x", digest[:-1], digest.upper(), "x" + digest):
        assert not is_digest_name(foreign)
