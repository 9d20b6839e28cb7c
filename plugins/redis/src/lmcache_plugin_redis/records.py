"""How the ``redis`` adapter keeps an object: one string, core's record -- its header, then
its payload, as a record file holds them.

Why a string: ``SET name <header><payload>`` is one atomic command, so a reader (another
server too) sees the old object or the new one, never half of either; and Redis keeps a
large string argument's request buffer as the value itself, where a hash field's value
is copied out of the request into memory of its own (``HSET``): on this project's 2-core
machine a 1 MiB ``HSET`` took ~1.1 ms against ~0.6 ms for a ``SET`` of the same bytes on
the same connection, the copy's fresh pages faulted in for every store.  The header is
sent from its own buffer and the payload from the caller's: nothing is joined on the
client (writes.py).

A lookup (and a listing) reads the first ``HEAD_READ`` bytes (``GETRANGE``) and the
value's length (``STRLEN``) in one trip.  The header says its own length in its first
``PREFIX_SIZE`` bytes; one longer than ``HEAD_READ`` (a very long key) is read again
whole.  The header is verified by its crc, and the value must be as long as header and
payload together: a crc-valid header beside another payload (a buggy writer's) is damage,
never a size to account.
"""

from __future__ import annotations

import hashlib

from lmcache_tiers.plugin import PREFIX_SIZE, RecordCorruptError, RecordError, header_length

__all__ = [
    "HEAD_READ",
    "NO_GUARD",
    "REMOVE_IF_UNCHANGED",
    "REMOVE_IF_UNCHANGED_SHA",
    "PayloadGuard",
    "digest_guard",
    "length_guard",
    "payload_mismatch",
    "split_head",
]

#: bytes a lookup, a listing or a delete reads from the start of a value: the whole
#: header of nearly every record (~160 bytes for a 33-character model name, a layout and
#: one serde), without most of the payload; only keys near the longest model name and
#: salt make a longer header (~520 bytes), which is read again whole
HEAD_READ = 512

#: removes a record only if its value still starts with the bytes judged (ARGV[1]: the
#: header read, or the head of a value that is no record; "" for a name that held
#: nothing, which removes only an empty value): a record another writer stored there
#: since is not the one judged, and is kept.  A record judged by its payload too (ARGV[2],
#: ARGV[3]: a ``PayloadGuard``) is removed only while it is still the value judged bad --
#: the same object stored again since starts with the very header read, and is intact:
#: "length" and the value's length read, "sha1" and the digest of the value read.
#: Replies 1 when it removed the record.  (GETRANGE 0 -1 would be the whole value: an
#: empty ARGV[1] is checked by the length instead.)
REMOVE_IF_UNCHANGED = """
local head = ARGV[1]
if #head > 0 then
  if redis.call('GETRANGE', KEYS[1], 0, #head - 1) ~= head then return 0 end
elseif redis.call('STRLEN', KEYS[1]) ~= 0 then return 0 end
if ARGV[2] == 'length' then
  if redis.call('STRLEN', KEYS[1]) ~= tonumber(ARGV[3]) then return 0 end
elseif ARGV[2] == 'sha1' then
  local value = redis.call('GET', KEYS[1])
  if not value or redis.sha1hex(value) ~= ARGV[3] then return 0 end
end
return redis.call('UNLINK', KEYS[1])
"""
#: the digest EVALSHA calls it by (a store that lacks it answers NOSCRIPT, and is sent it)
REMOVE_IF_UNCHANGED_SHA = hashlib.sha1(REMOVE_IF_UNCHANGED.encode()).hexdigest()

#: what the removal script compares the stored value with besides its head (see
#: ``REMOVE_IF_UNCHANGED``); ``NO_GUARD`` for a record judged by its head alone
PayloadGuard = tuple[()] | tuple[bytes, int | str]
NO_GUARD: PayloadGuard = ()


def length_guard(total: int | None) -> PayloadGuard:
    """The guard of a value judged by its length (``total`` bytes; None: not known, the
    head alone is compared)."""
    return NO_GUARD if total is None else (b"length", total)


def digest_guard(*parts: bytes | memoryview) -> PayloadGuard:
    """The guard of a payload that failed its checksum: the digest of the value read
    (``parts`` in order: header, payload).  Its length cannot tell it from the object
    stored again (the header's length either way), and Lua has no crc32;
    ``redis.sha1hex`` is built into Redis and Valkey scripts.  Hashed on this failure
    path only, never on a load that verifies."""
    digest = hashlib.sha1()
    for part in parts:
        digest.update(part)
    return (b"sha1", digest.hexdigest())


def split_head(head: bytes, total: int | None) -> bytes | int | RecordError | None:
    """The header at the start of a value, from ``head`` (its first bytes as read) and
    ``total`` (its length; None: not known).  None for a name that holds nothing (an empty
    value reads the same); the header's length when ``head`` holds only part of it (read
    that many bytes again); a ``RecordError`` for a value that cannot hold a record:
    shorter than a header's start, a start that is no header's, or shorter than the
    header it starts with."""
    if not head:
        return None
    if len(head) < PREFIX_SIZE:
        return RecordCorruptError(f"a value of {len(head)} bytes is shorter than a record header")
    try:
        length = header_length(head[:PREFIX_SIZE])
    except RecordError as exc:
        return exc
    if total is not None and length > total:
        return RecordCorruptError(f"the value is {total} bytes, its record header alone {length}")
    if length > len(head):
        return length
    return head[:length]


def payload_mismatch(payload_len: int, described: int) -> RecordError:
    """Why a record whose intact header describes another payload than the one beside it
    is damage, not an object to serve or account."""
    return RecordError(f"the payload is {max(payload_len, 0)} bytes, its header says {described}")
