import pathlib
import subprocess
import sys

import pytest

from lmcache_tiers.errors import KeyValidationError
from lmcache_tiers.keys import NONE_HASH, ObjectKey, chunk_hashes, kv_rank_of, prefix_keys

TOKENS = (0,) + (9906,) * 1024


def test_none_hash_is_blake3_of_twelve_zero_bytes() -> None:
    assert NONE_HASH.hex() == "7e3eff9ef7613a50340eb12677ee03b83ac759fcba9bb32705f07248d56d473b"


def test_chunk_hashes_match_lmcache_reference_vector() -> None:
    hashes = chunk_hashes(TOKENS, 256)
    assert [h.hex()[:8] for h in hashes] == ["d65391f7", "4d033f8a", "052ad337", "e3edc710"]


def test_partial_tail_is_never_hashed() -> None:
    assert len(chunk_hashes(TOKENS[:511], 256)) == 1
    assert chunk_hashes(TOKENS[:255], 256) == []


def test_hash_is_a_rolling_prefix_hash() -> None:
    a = chunk_hashes([1] * 512, 256)
    b = chunk_hashes([2] * 256 + [1] * 256, 256)
    assert a[0] != b[0] and a[1] != b[1]


def test_hashes_are_identical_in_another_process() -> None:
    code = (
        "from lmcache_tiers.keys import chunk_hashes; print(chunk_hashes(list(range(1024)), 256)[-1].hex())"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == chunk_hashes(list(range(1024)), 256)[-1].hex()


def test_tokens_must_fit_uint32() -> None:
    with pytest.raises(KeyValidationError):
        chunk_hashes([1 << 32] * 4, 4)


def test_kv_rank_packing() -> None:
    assert kv_rank_of(1, 0) == 0x01000100
    assert kv_rank_of(4, 3) == 0x04030403
    with pytest.raises(KeyValidationError):
        kv_rank_of(2, 2)


def test_keys_are_hashable_and_round_trip() -> None:
    key = prefix_keys(TOKENS, 256, model_name="m", kv_rank=kv_rank_of(1, 0), cache_salt="tenant")[0]
    assert ObjectKey.from_bytes(key.to_bytes()) == key
    assert len({key, ObjectKey.from_bytes(key.to_bytes())}) == 1
    assert key.file_stem() == f"m@0x01000100@0@{key.chunk_hash.hex()}@tenant"


def test_salt_changes_identity() -> None:
    digest = chunk_hashes(TOKENS, 256)[0]
    assert ObjectKey("m", 0, digest) != ObjectKey("m", 0, digest, cache_salt="a")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"model_name": "a@b"},
        {"model_name": "a\x00b"},
        {"model_name": ""},
        {"model_name": "x" * 300},
        {"cache_salt": "a\\b"},
        {"cache_salt": "a/b"},
        {"cache_salt": "a\x00"},
        {"cache_salt": "s" * 129},
        {"model_name": "a\ud800"},  # a lone surrogate: no UTF-8 form, so no record header
        {"cache_salt": "\udfff"},
        {"chunk_hash": b""},
        {"kv_rank": -1},
        {"object_group": 1 << 16},
    ],
)
def test_unsafe_fields_are_rejected(kwargs: dict[str, object]) -> None:
    fields: dict[str, object] = {"model_name": "m", "kv_rank": 0, "chunk_hash": b"h"}
    fields.update(kwargs)
    with pytest.raises(KeyValidationError):
        ObjectKey(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("model_name", ["meta-llama/Llama-3.1-8B", "../etc", "a\\b", "Qwen/Qwen3 8B"])
def test_model_names_may_hold_path_separators_never_written_as_paths(model_name: str) -> None:
    """As in LMCache, a model name is what the engine calls the model; names of files
    escape it, so a separator never reaches the file system."""
    from lmcache_tiers.keycodec import name_to_key

    key = ObjectKey(model_name, 0, b"\x01")
    stem = key.file_stem()
    assert "/" not in stem and "\\" not in stem and not stem.startswith(".")
    assert name_to_key(stem) == key
    assert ObjectKey.from_bytes(key.to_bytes()) == key


@pytest.mark.parametrize("model_name", ["m", ".", ".."])
@pytest.mark.parametrize("cache_salt", [".", ".."])
def test_dot_names_are_keys_whose_names_stay_inside_the_root(
    model_name: str, cache_salt: str, tmp_path: pathlib.Path
) -> None:
    """As in LMCache, a salt (or model name) may be ``.`` or ``..``: every name made from
    a key escapes a leading dot, and the salt is never a path part of its own."""
    from lmcache_tiers.keycodec import key_to_name, name_to_key
    from lmcache_tiers.l2.files.layout import FileLayout, record_name

    key = ObjectKey(model_name, 0x01000100, bytes(range(32)), 0, cache_salt)
    assert ObjectKey.from_bytes(key.to_bytes()) == key
    name = key_to_name(key)
    assert name == key.file_stem() and name_to_key(name) == key
    assert "/" not in name and not name.startswith(".") and name.endswith("@%2E" + cache_salt[1:])
    for shard_dirs in (False, True):
        path = pathlib.Path(FileLayout(str(tmp_path), shard_dirs=shard_dirs).path_for(key))
        assert path.name == record_name(key) and path.parent.is_relative_to(tmp_path)
        assert ".." not in path.relative_to(tmp_path).parts and path.resolve().parent.is_relative_to(tmp_path)


def test_decoding_validates_too() -> None:
    import msgspec

    bad = msgspec.msgpack.encode(["a@b", 0, b"h", 0, ""])
    with pytest.raises(KeyValidationError):
        ObjectKey.from_bytes(bad)


def test_remembered_names_keep_every_check() -> None:
    import msgspec

    from lmcache_tiers import keys as keys_module

    ObjectKey("m", 0, b"h", cache_salt="s")  # both names are now remembered
    for chunk_hash, kv_rank, group in ((b"", 0, 0), (b"h", 1 << 32, 0), (b"h", 0, -1)):
        with pytest.raises(KeyValidationError):
            ObjectKey("m", kv_rank, chunk_hash, group, "s")
    with pytest.raises(KeyValidationError):
        ObjectKey.from_bytes(msgspec.msgpack.encode(["m", 0, b"h", 0, "s/"]))
    with pytest.raises(KeyValidationError):
        ObjectKey(["m"], 0, b"h")  # type: ignore[arg-type]

    class Name(str):
        pass

    ObjectKey(Name("subclassed"), 0, b"h")
    assert "subclassed" not in keys_module._CHECKED_MODEL_NAMES  # only exact str values
    for index in range(keys_module._MAX_CHECKED_NAMES + 10):
        ObjectKey(f"model-{index}", 0, b"h")
    assert len(keys_module._CHECKED_MODEL_NAMES) <= keys_module._MAX_CHECKED_NAMES


def test_names_that_pose_as_checked_ones_are_refused_as_not_strings() -> None:
    """A key built after others whose names passed: a value comparing equal to one of them
    without being a str, or whose comparison raises, is no name, whichever way the
    remembered names are consulted."""
    ObjectKey("m", 0, b"h", cache_salt="s")

    class Equal:
        def __eq__(self, other: object) -> bool:
            raise ValueError("ambiguous")

        def __hash__(self) -> int:
            return hash("m")

    for model_name, cache_salt in ((Equal(), "s"), ("m", Equal())):
        with pytest.raises(KeyValidationError, match="must be a string"):
            ObjectKey(model_name, 0, b"h", cache_salt=cache_salt)  # type: ignore[arg-type]
    assert ObjectKey("m", 0, b"h", cache_salt="s") == ObjectKey("m", 0, b"h", 0, "s")
