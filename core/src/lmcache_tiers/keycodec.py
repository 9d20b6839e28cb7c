"""Object names for keys: one codec for files, S3 objects and remote-store keys.

Every adapter that turns an :class:`~lmcache_tiers.keys.ObjectKey` into a name in a
namespace it shares with other things (a directory, a bucket, a Redis database) uses
:func:`key_to_name` and reads names back with :func:`name_to_key`, so:

* a name is always safe: only ``[A-Za-z0-9._-]``, ``%`` escapes and the ``@``
  separators; never a path separator, never starting with ``.`` (hidden, and ``.`` /
  ``..``), so nothing is written outside the configured root and listings never skip it;
* a name round-trips: ``name_to_key(key_to_name(key)) == key`` for every valid key,
  whatever characters its model name or cache salt hold (control characters, a leading
  dot, unicode);
* for the plain names nearly everybody uses (``[A-Za-z0-9._-]``, no leading dot) the
  name is ``ObjectKey.file_stem()``: caches written before this codec keep their names;
* a name never exceeds ``max_len`` bytes: a key whose readable name would (very long
  unicode model names) gets a digest name, ``~`` + 32 hex digits of a hash of the whole
  key.  A digest name cannot be decoded; its key is in the object's record header, which
  every persistent adapter stores (:mod:`lmcache_tiers.l2.record`), so a listing reads
  the header of such objects only.
"""

from __future__ import annotations

import functools
import re

import xxhash

from lmcache_tiers.errors import KeyValidationError
from lmcache_tiers.keys import ObjectKey

__all__ = [
    "DIGEST_PREFIX",
    "NAME_MAX",
    "is_digest_name",
    "key_to_name",
    "name_to_key",
    "printable",
]

#: longest file name most Linux filesystems accept, in bytes
NAME_MAX = 255
#: first character of a digest name (a character no readable name starts with)
DIGEST_PREFIX = "~"
_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")
_DIGEST = re.compile(r"~[0-9a-f]{32}")  # fullmatch: ``$`` would allow a final newline


# Every load and lookup of a file store names its key's file, and nearly all keys share a
# handful of model names and salts: escaping them byte by byte in Python on each call took
# a few microseconds per key (more right after a large copy left the caches cold).
@functools.lru_cache(maxsize=4096)
def _escape(text: str) -> str:
    """Percent-escape every byte outside the safe set, and a leading dot."""
    data = text.encode("utf-8", "surrogatepass")
    out: list[str] = []
    for position, byte in enumerate(data):
        if byte in _SAFE and not (position == 0 and byte == 0x2E):
            out.append(chr(byte))
        else:
            out.append(f"%{byte:02X}")
    return "".join(out)


# Listings decode every file name, and nearly all share a handful of model names and
# salts: remembering them took a name's decoding from ~10 to ~3 microseconds.
@functools.lru_cache(maxsize=4096)
def _unescape(text: str) -> str | None:
    """Inverse of :func:`_escape`; None for anything ``_escape`` cannot have produced."""
    data = bytearray()
    position = 0
    while position < len(text):
        char = text[position]
        if char == "%":
            pair = text[position + 1 : position + 3]
            if len(pair) != 2 or not all(c in "0123456789ABCDEF" for c in pair):
                return None
            data.append(int(pair, 16))
            position += 3
            continue
        code = ord(char)
        if code > 0x7F or code not in _SAFE or (position == 0 and char == "."):
            return None
        data.append(code)
        position += 1
    try:
        # Strict: escaped lone surrogates would make a key no record header can encode.
        decoded = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    # Canonical form only: one key, one name (a name escaping a safe byte is not ours).
    return decoded if _escape(decoded) == text else None


def readable_name(key: ObjectKey) -> str:
    """The readable form, whatever its length (:func:`key_to_name` bounds it)."""
    stem = f"{_escape(key.model_name)}@0x{key.kv_rank:08x}@{key.object_group}@{key.chunk_hash.hex()}"
    return f"{stem}@{_escape(key.cache_salt)}" if key.cache_salt else stem


def digest_name(key: ObjectKey) -> str:
    return DIGEST_PREFIX + xxhash.xxh3_128_hexdigest(key.to_bytes())


def key_to_name(key: ObjectKey, max_len: int = NAME_MAX) -> str:
    """The name of ``key``'s object: readable when it fits in ``max_len`` bytes, else a
    digest name.  Callers that add a suffix pass ``max_len`` minus its length."""
    if max_len < 33:
        raise ValueError(f"max_len {max_len} cannot hold a digest name (33 bytes)")
    name = readable_name(key)
    return name if len(name) <= max_len else digest_name(key)


def is_digest_name(name: str) -> bool:
    """True for a name whose key must be read from the object's record header."""
    return _DIGEST.fullmatch(name) is not None


def name_to_key(name: str) -> ObjectKey | None:
    """The key a readable name was made from; None for digest names and foreign names."""
    parts = name.split("@")
    if len(parts) not in (4, 5):
        return None
    model, rank, group, digest = parts[:4]
    # Listings decode every file name: canonical-form checks by re-formatting the parsed
    # numbers cost less than regular expressions (one key, one name, as in key_to_name).
    try:
        rank_value, group_value, chunk_hash = int(rank[2:], 16), int(group), bytes.fromhex(digest)
    except ValueError:
        return None
    if (
        rank != f"0x{rank_value:08x}"
        or group != str(group_value)
        or digest != chunk_hash.hex()
        or not chunk_hash
    ):
        return None
    model_name = _unescape(model)
    cache_salt = _unescape(parts[4]) if len(parts) == 5 else ""
    if model_name is None or cache_salt is None or (len(parts) == 5 and not cache_salt):
        return None
    try:
        return ObjectKey(model_name, rank_value, chunk_hash, group_value, cache_salt)
    except (KeyValidationError, ValueError):
        return None


def printable(text: str, limit: int = 120) -> str:
    """``text`` safe for one log line: control characters escaped, length bounded.

    Model names and salts come from clients; a newline or an escape sequence in one must
    not forge or garble log lines.
    """
    escaped = text.encode("unicode_escape").decode("ascii") if not text.isprintable() else text
    return escaped if len(escaped) <= limit else escaped[: limit - 3] + "..."
