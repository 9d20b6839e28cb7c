"""Object keys and the token-chunk hasher.

Keys are derived the same way as LMCache's default (blake3, tokens as big-endian uint32,
the first chunk chained onto blake3 of 12 zero bytes), so every front end -- and LMCache
itself -- derives identical keys from identical tokens, in any process, after restarts.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence

import blake3
import msgspec

from lmcache_tiers.errors import KeyValidationError

#: blake3 of int64_be(0) || uint32_be(0): the hash the first chunk is chained onto.
NONE_HASH: bytes = blake3.blake3(bytes(12)).digest()

MAX_MODEL_NAME_LEN = 256
MAX_CACHE_SALT_LEN = 128
MAX_CHUNK_HASH_LEN = 64
#: ``@`` separates the parts of a key's name; NUL ends C strings.  A model name may hold
#: ``/`` (``meta-llama/Llama-3.1-8B``): names of files and objects escape it
#: (:mod:`lmcache_tiers.keycodec`).  A cache salt may not, as in LMCache.  Either may be
#: ``.`` or ``..``, as in LMCache: a name is never a path part of its own, and the codec
#: escapes a leading dot.
_UNSAFE_MODEL = re.compile(r"[@\x00]")
_UNSAFE_SALT = re.compile(r"[/\\@\x00]")
#: Names that passed _check_name, per field.  A server decodes every key of every request,
#: and nearly all of them share a handful of names: re-running the checks for each key
#: was most of the cost of decoding a LOOKUP.  Only exact ``str`` values are remembered,
#: and a set is emptied when full, so a client sending many names cannot grow it.
_CHECKED_MODEL_NAMES: set[str] = set()
_CHECKED_SALTS: set[str] = set()
_MAX_CHECKED_NAMES = 4096
#: The model name and salt that passed _check_names last, compared before the sets are
#: probed: a decoded key's names are new str objects, each hashed in full by a probe, and
#: two comparisons cost less.  Nothing equals the initial placeholders.
_LAST_CHECKED: tuple[object, object] = (object(), object())
_KV_RANK_LIMIT = 1 << 32
_OBJECT_GROUP_LIMIT = 1 << 16


def kv_rank_of(world_size: int, worker_id: int) -> int:
    """LMCache's kv_rank packing: ``ws<<24 | wid<<16 | ws<<8 | wid``."""
    if not (0 < world_size < 256 and 0 <= worker_id < world_size):
        raise KeyValidationError(f"bad world_size/worker_id: {world_size}/{worker_id}")
    return world_size << 24 | worker_id << 16 | world_size << 8 | worker_id


def _check_name(field: str, value: str, limit: int, unsafe: re.Pattern[str], *, allow_empty: bool) -> None:
    if not isinstance(value, str):
        raise KeyValidationError(f"{field} must be a string, got {type(value).__name__}")
    if not value and not allow_empty:
        raise KeyValidationError(f"{field} must not be empty")
    if len(value) > limit:
        raise KeyValidationError(f"{field} is {len(value)} characters long; at most {limit}")
    if unsafe.search(value):
        characters = "'@' or NUL" if unsafe is _UNSAFE_MODEL else "'/', '\\', '@' or NUL"
        raise KeyValidationError(f"{field} {value!r} contains {characters}")
    if not value.isascii():
        # A lone surrogate has no UTF-8 form: such a key could not be encoded (to_bytes,
        # record headers, digest names).
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise KeyValidationError(f"{field} {value!r} holds a lone surrogate") from None


def _check_names(model_name: str, cache_salt: str) -> None:
    _check_name("model_name", model_name, MAX_MODEL_NAME_LEN, _UNSAFE_MODEL, allow_empty=False)
    _check_name("cache_salt", cache_salt, MAX_CACHE_SALT_LEN, _UNSAFE_SALT, allow_empty=True)
    for checked, value in ((_CHECKED_MODEL_NAMES, model_name), (_CHECKED_SALTS, cache_salt)):
        if type(value) is str:
            if len(checked) >= _MAX_CHECKED_NAMES:
                checked.clear()
            checked.add(value)
    if type(model_name) is str and type(cache_salt) is str:
        global _LAST_CHECKED
        _LAST_CHECKED = (model_name, cache_salt)


def _validate(key: ObjectKey) -> None:
    """Check every field of ``key`` (names first, then the numbers) and raise for the first
    one that is wrong; remembers names that pass."""
    try:
        known = key.model_name in _CHECKED_MODEL_NAMES and key.cache_salt in _CHECKED_SALTS
    except Exception:  # unhashable, or not comparable with a str: not a string, as _check_name says
        known = False
    if not known:
        _check_names(key.model_name, key.cache_salt)
    chunk_hash = key.chunk_hash
    if not isinstance(chunk_hash, bytes) or not 0 < len(chunk_hash) <= MAX_CHUNK_HASH_LEN:
        raise KeyValidationError(f"chunk_hash must be 1..{MAX_CHUNK_HASH_LEN} bytes")
    for field in ("kv_rank", "object_group"):
        value = getattr(key, field)
        # A bool or a float equal to an int passes the bounds, and the key then equals one
        # of that int, but it encodes as a bool or a float, which the server refuses.
        if not isinstance(value, int) or isinstance(value, bool):
            raise KeyValidationError(f"{field} must be an int, got {type(value).__name__} {value!r}")
    if not 0 <= key.kv_rank < _KV_RANK_LIMIT:
        raise KeyValidationError(f"kv_rank {key.kv_rank} is outside 0..2**32-1")
    if not 0 <= key.object_group < _OBJECT_GROUP_LIMIT:
        raise KeyValidationError(f"object_group {key.object_group} is outside 0..65535")


# cache_hash: a key is hashed by every dict and set it passes through (L1, the eviction
# policy, per-client lock records...), several times per request; being frozen, it can
# keep the hash it computed first.
class ObjectKey(msgspec.Struct, frozen=True, array_like=True, gc=False, cache_hash=True):
    """Identity of one cached chunk object; immutable, hashable, validated on creation."""

    model_name: str
    kv_rank: int
    chunk_hash: bytes
    object_group: int = 0
    cache_salt: str = ""

    def __post_init__(self) -> None:
        # Runs for every key of every request a server decodes (most of the cost of
        # decoding a key never seen): the usual case is one compound test.  A value equal
        # to an exact str that passed the checks (the last names, else a remembered one)
        # has the same characters, so it passes them too.  Anything else is checked field
        # by field, which says what is wrong.
        chunk_hash, rank, group = self.chunk_hash, self.kv_rank, self.object_group
        last = _LAST_CHECKED
        try:
            if (
                (
                    (last[0] == self.model_name and last[1] == self.cache_salt)
                    or (self.model_name in _CHECKED_MODEL_NAMES and self.cache_salt in _CHECKED_SALTS)
                )
                and isinstance(chunk_hash, bytes)
                and 0 < len(chunk_hash) <= MAX_CHUNK_HASH_LEN
                and type(rank) is int is type(group)  # not a bool or a float equal to an int
                and 0 <= rank < _KV_RANK_LIMIT
                and 0 <= group < _OBJECT_GROUP_LIMIT
            ):
                return
        except Exception:  # e.g. an unhashable name, a number that is no number: said below
            pass
        _validate(self)

    def file_stem(self) -> str:
        """Safe, unique name for files, objects and log lines: ``model@0xRANK@group@hash[@salt]``
        with every byte of model name and salt outside ``[A-Za-z0-9._-]`` (and a leading dot)
        ``%XX``-escaped, so a control character in a client's name can never garble a log
        line (:func:`lmcache_tiers.keycodec.readable_name`; unbounded in length, which
        ``key_to_name`` bounds for file names)."""
        from lmcache_tiers.keycodec import readable_name

        return readable_name(self)

    def to_bytes(self) -> bytes:
        return _KEY_ENCODER.encode(self)

    @classmethod
    def from_bytes(cls, data: bytes) -> ObjectKey:
        try:
            return _KEY_DECODER.decode(data)
        except msgspec.ValidationError as exc:
            raise KeyValidationError(f"invalid encoded key: {exc}") from exc


_KEY_ENCODER = msgspec.msgpack.Encoder()
_KEY_DECODER = msgspec.msgpack.Decoder(ObjectKey)


def chunk_hashes(tokens: Sequence[int], chunk_size: int, prefix_hash: bytes = NONE_HASH) -> list[bytes]:
    """Rolling blake3 hash of every *full* chunk of ``tokens``; a partial tail is dropped."""
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    full = len(tokens) // chunk_size
    hashes: list[bytes] = []
    previous = prefix_hash
    pack = struct.Struct(f">{chunk_size}I").pack
    try:
        for index in range(full):
            chunk = tokens[index * chunk_size : (index + 1) * chunk_size]
            previous = blake3.blake3(previous + pack(*chunk)).digest()
            hashes.append(previous)
    except struct.error as exc:
        raise KeyValidationError(f"token ids must fit in uint32: {exc}") from exc
    return hashes


def prefix_keys(
    tokens: Sequence[int],
    chunk_size: int,
    *,
    model_name: str,
    kv_rank: int = 0,
    object_group: int = 0,
    cache_salt: str = "",
) -> list[ObjectKey]:
    """ObjectKeys of every full chunk of ``tokens``, in prefix order."""
    return [
        ObjectKey(model_name, kv_rank, digest, object_group, cache_salt)
        for digest in chunk_hashes(tokens, chunk_size)
    ]
