"""Moving a record's payload and checksumming it in the same pass: what every persistent
backend does on a load (and the slot stores on a store).

A payload is handed out only after all of it matched its header's checksum.  Taken after
the whole payload landed, that checksum reads it a second time from memory: a 1 MiB copy
(the kernel's from the page cache, or a memcpy out of a mapping) leaves little of it in
the core's cache, and on this project's 2-core machines the second pass added 15-30 % to
the copy.  Here the payload moves in pieces of :data:`VERIFY_PIECE` bytes and each piece
is hashed right after it landed, while it is still in cache, so the checksum costs little
beyond the copy; the bytes hashed are those of the caller's buffer, i.e. exactly what is
handed out.

* :func:`read_record_file` -- a record file (header, then payload) read with ``preadv``
  into a header scratch and the caller's buffer; the header is decoded and checked before
  the payload's pieces are read;
* :func:`copy_verified` -- a payload in memory (a mapped slot) copied into the caller's
  buffer and verified against its header;
* :func:`copy_and_checksum` -- the store side: a payload copied into place, returning the
  checksum of the copy for its header (``encode_header(..., digest=)``).

Copies of a piece release the GIL (numpy), and so do the system calls and xxhash.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import xxhash

from lmcache_tiers.l2.buffers import copy_into, copy_views
from lmcache_tiers.l2.record import (
    PayloadVerifier,
    RecordCorruptError,
    RecordHeader,
    checksum,
    verify_payload,
)

__all__ = [
    "STORE_PIECE",
    "VERIFY_PIECE",
    "copy_and_checksum",
    "copy_verified",
    "read_and_digest",
    "read_record_file",
]

#: bytes moved and hashed at a time.  A piece must stay in the core's cache from its copy to
#: its hash (a core's L2 here is 2 MiB), and every piece costs each thread two hand-backs
#: of the GIL (after the copy and after the hash).  Loads run on two or more threads, and
#: there the hand-backs are what cost: a 1 MiB slot load on two threads ran at 0.47x of a
#: two-thread memcpy in 256 KiB pieces, 0.59x in 512 KiB and 0.73x in 1 MiB pieces (one
#: thread alone prefers 256 KiB: 0.85x against 0.74x of a one-thread memcpy).
VERIFY_PIECE = 1 << 20
#: bytes copied and hashed at a time on a store: stores run on one write-back thread, where
#: pieces small enough to be hashed from the core's L1/L2 right after their copy win (a
#: 16 MiB dax store ran at 0.46x of a two-thread memcpy in 256 KiB pieces, 0.40x in 1 MiB)
STORE_PIECE = 256 << 10


def _read_rest(fd: int, pieces: list[memoryview], offset: int, got: int) -> int:
    """Go on filling ``pieces`` after a short ``preadv`` that read ``got`` bytes of them;
    the bytes read in all (fewer only at end of file)."""
    total = got
    pending = [piece for piece in pieces if piece.nbytes]
    while True:
        while pending and got >= pending[0].nbytes:
            got -= pending[0].nbytes
            pending.pop(0)
        if not pending:
            return total
        if got:
            pending[0] = pending[0][got:]
        got = os.preadv(fd, pending, offset + total)
        if got <= 0:
            return total
        total += got


def read_record_file(
    fd: int,
    header: memoryview,
    payload: memoryview,
    decode: Callable[[memoryview], RecordHeader | None],
    *,
    first_piece: int | None = None,
    stop: Callable[[], bool] | None = None,
) -> bool:
    """Read the record stored at the start of ``fd`` and verify it on the way.

    ``header`` receives the header (its exact length, known from the key), ``payload`` the
    payload (its exact length, known from the lookup); ``decode`` checks the header
    (``BackendContext.read_record_header`` bound to the key).  The first ``preadv`` reads
    the header and ``first_piece`` payload bytes (default :data:`VERIFY_PIECE`) together.

    True: every payload byte is in ``payload`` and matched the header's checksum.  False:
    a miss to keep -- the file ended early (it changed since it was sized) or the record
    is intact but of another serde chain, or ``stop()`` said so before a piece was read
    (the caller may no longer write to ``payload``).  Raises a ``RecordError`` for a
    damaged record or one of other lengths (the caller removes it) and ``OSError`` for a
    failed read.
    """
    header_len = header.nbytes
    length = payload.nbytes
    piece = payload[: max(1, first_piece or VERIFY_PIECE)]
    want = header_len + piece.nbytes
    got = os.preadv(fd, [header, piece], 0)
    if got != want and _read_rest(fd, [header, piece], 0, got) != want:
        return False
    record = decode(header)
    if record is None:
        return False
    if record.header_len != header_len or record.payload_len != length:
        raise RecordCorruptError(
            f"record header says {record.header_len}+{record.payload_len} bytes, "
            f"the file holds {header_len}+{length}"
        )
    if piece.nbytes == length:
        verify_payload(record, payload)  # one piece: the one-shot hash outruns a stream
        return True
    # Each piece is hashed right after it landed; the system calls and xxhash release
    # the GIL.
    verifier = PayloadVerifier(record)
    verifier.hash_update(piece)
    if not _read_hashing(fd, payload, header_len, piece.nbytes, verifier.hash_update, stop):
        return False
    verifier.verify(length)
    return True


def _read_hashing(
    fd: int,
    payload: memoryview,
    offset: int,
    position: int,
    update: Callable[[memoryview], object],
    stop: Callable[[], bool] | None = None,
) -> bool:
    """Read ``payload[position:]`` from ``fd`` at ``offset + position`` in pieces of
    :data:`VERIFY_PIECE`, ``update(piece)`` with each right after it landed; False when
    the file ended early or ``stop()`` said so before a piece.  The pieces are cut from
    the payload as they are read (no list of views)."""
    length = payload.nbytes
    while position < length:
        if stop is not None and stop():
            return False  # the payload buffer may no longer be the caller's to fill
        piece = payload[position : position + VERIFY_PIECE]
        want = piece.nbytes
        got = os.preadv(fd, [piece], offset + position)
        if got != want and _read_rest(fd, [piece], offset + position, got) != want:
            return False
        update(piece)
        position += want
    return True


def read_and_digest(
    path: str,
    header: memoryview,
    payload: memoryview,
    *,
    first_piece: int = VERIFY_PIECE,
    stop: Callable[[], bool] | None = None,
) -> bytes | None:
    """Open ``path``, read the record's header into ``header`` and its payload into
    ``payload`` (both of their exact lengths) and return the payload's XXH3-128 digest,
    each piece hashed right after it landed; close the file.

    Nothing is checked here: the caller decodes ``header`` and compares the digest with
    its checksum before it trusts a byte (:meth:`~lmcache_tiers.l2.files.RecordLoads.load_many`).
    None: no such file, a file shorter than expected, a failed read, or ``stop()`` said so
    before a read (the buffers may no longer be the caller's to fill).
    """
    if stop is not None and stop():
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    if stop is not None and stop():  # closed while the open was stuck (a hung mount)
        os.close(fd)
        return None
    try:
        length = payload.nbytes
        piece = payload[: max(1, first_piece)]
        want = header.nbytes + piece.nbytes
        got = os.preadv(fd, [header, piece], 0)
        if got != want and _read_rest(fd, [header, piece], 0, got) != want:
            return None
        if piece.nbytes == length:
            return xxhash.xxh3_128_digest(payload)  # one piece: the one-shot hash outruns a stream
        hasher = xxhash.xxh3_128()
        hasher.update(piece)
        if not _read_hashing(fd, payload, header.nbytes, piece.nbytes, hasher.update, stop):
            return None
        return hasher.digest()
    except OSError:
        return None
    finally:
        os.close(fd)


def _copy_hashing(
    out: memoryview, data: memoryview, update: Callable[[memoryview], object], piece: int
) -> int:
    """Copy ``data`` into ``out`` (byte views of equal lengths, see ``copy_views``) ``piece``
    bytes at a time, ``update(piece)`` with each piece of ``out`` right after it was
    copied; the bytes copied."""
    into, origin = np.frombuffer(out, dtype=np.uint8), np.frombuffer(data, dtype=np.uint8)
    for start in range(0, out.nbytes, piece):
        end = start + piece
        np.copyto(into[start:end], origin[start:end])
        update(out[start:end])
    return out.nbytes


def copy_verified(target: memoryview, source: bytes | bytearray | memoryview, record: RecordHeader) -> None:
    """Copy ``source`` into ``target`` (same length) and verify the copy against
    ``record``'s payload checksum; raises ``RecordChecksumError`` when it does not match
    (``target`` then holds bytes nobody may hand out)."""
    out, data = copy_views(target, source)
    if out.nbytes <= VERIFY_PIECE:
        copy_into(out, data)
        verify_payload(record, out)  # one piece: the one-shot hash outruns a stream
        return
    verifier = PayloadVerifier(record)
    verifier.verify(_copy_hashing(out, data, verifier.hash_update, VERIFY_PIECE))


def copy_and_checksum(
    target: memoryview, source: bytes | bytearray | memoryview, *, piece: int | None = None
) -> bytes:
    """Copy ``source`` into ``target`` (same length); the XXH3-128 checksum of the copy,
    as :func:`~lmcache_tiers.l2.record.checksum` gives it, for the record header.

    ``piece``: bytes copied and hashed at a time, :data:`STORE_PIECE` by default (one
    store thread; where several threads copy at once, larger pieces win: fewer GIL
    hand-backs, each of which costs more when another thread wants the GIL)."""
    out, data = copy_views(target, source)
    step = piece or STORE_PIECE
    if out.nbytes <= step:
        copy_into(out, data)
        return checksum(out)
    hasher = xxhash.xxh3_128()
    _copy_hashing(out, data, hasher.update, step)
    return bytes(hasher.digest())
