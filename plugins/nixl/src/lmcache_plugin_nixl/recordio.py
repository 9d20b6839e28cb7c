"""Record files of nixl_store_dynamic: header by plain file I/O, payload through NIXL.

A record file is core's record header (magic, version, key, lengths, serde chain, XXH3-128
checksum of the payload) padded to 4096 bytes, then the payload.  Headers go through
NIXL too, from page-aligned staging blocks registered once and reused: writing or reading them
with a system call per file would, with ``O_DIRECT``, wait for the device once per object.
A load reads each file's header and payload in the same request (the header's length
follows from the key, the payload's from the size the lookup reported) and checks the
header before trusting the payload.  The padding keeps payloads block-aligned so
``O_DIRECT`` can be used for them.

Checksums cost about as much CPU as the copies themselves, so they are taken off the
critical path: on store the helper thread computes them (and encodes the headers) while
NIXL writes the payloads, the headers being written last; on load NIXL reads the batch in
groups of about 16 MiB and the helper thread verifies each group while the following ones
are read.  NIXL (during its transfer call) and xxhash both release the GIL, so the two
overlap whenever a second core is free; when none is, a verified load costs the read
plus the checksum.  Buffered loads on the POSIX backend skip NIXL altogether
(:mod:`lmcache_plugin_nixl.plainreads`: ``preadv`` checksummed piece by piece while the
bytes are still in cache).

Writes go to a temporary file renamed over the final name only after header and payload
are complete (core's :class:`~lmcache_tiers.l2.files.LocalFiles`), so a crash leaves
either the old record, the new one, or a temporary file that the next start-up deletes.
No ``fsync``: a process crash keeps what the kernel already has, and after a power loss a
record that lost bytes fails its checksum and is treated as a miss.  Each temporary file
is given its full size with ``posix_fallocate`` before NIXL writes to it, so a full disk
fails exactly the records that do not fit, one by one, before the transfer (NIXL would
fail the whole request); a filesystem without ``fallocate`` skips that step.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from dataclasses import dataclass
from queue import SimpleQueue

import xxhash

from lmcache_plugin_nixl.memory import DIRECT_IO_ALIGN, HostMemory, buffer_address, direct_io_ok
from lmcache_plugin_nixl.plainreads import PlainReads
from lmcache_plugin_nixl.runtime import NixlRuntime, NixlTransferError, Registration
from lmcache_plugin_nixl.transfers import BatchTransfer, Locator, StorageRow
from lmcache_tiers.plugin import (
    ABSENT_FILE_ERRORS,
    WRITE_BACK,
    BackendContext,
    FileIdentity,
    HeaderSizes,
    LocalFiles,
    ObjectKey,
    ObjectSize,
    RecordError,
    RecordHeader,
    WriteFailures,
    identity_of,
    is_out_of_space,
    printable,
    record_name,
    verify_payload,
)

log = logging.getLogger(__name__)

HEADER_ALIGN = DIRECT_IO_ALIGN
#: A load is read in groups of about this many bytes (whole objects, at least one), each
#: one NIXL request, and each group is verified while the next ones are read.  Small
#: groups keep the verification of the last group (which nothing overlaps) short, but
#: each group costs ~0.1 ms of Python and NIXL set-up on the reading thread: 16 MiB
#: groups balance the two for batches of 1 MiB objects.
PIPELINE_GROUP_BYTES = 16 << 20
#: Files open at once per batch: a large batch is handled in slices of this many keys,
#: so the number of objects is never bounded by the open-file limit.
MAX_OPEN_FILES = 256
#: Header staging blocks hold one slice's headers at their usual size (4096 bytes).
STAGING_BLOCK_BYTES = MAX_OPEN_FILES * HEADER_ALIGN


@dataclass
class _Pending:
    """One object of a batch on its way to or from disk."""

    index: int
    fd: int
    path: str  # temporary path for writes, final path for reads
    offset: int  # where the payload starts: the header's length
    length: int  # payload bytes
    header: memoryview | None = None  # staging slot of a header being read
    identity: FileIdentity | None = None  # of the file read, so only that one is removed


class HeaderStaging:
    """Page-aligned memory for a batch's headers, one 4096-multiple slot each.

    Blocks are kept and reused, registered with NIXL once (pinned): allocating and
    registering a block per batch, or per pipeline group, cost milliseconds each time.
    A block serves one batch at a time; concurrent batches (the store and load
    controllers) get a block each, so there are about as many blocks as batches ever ran
    at once.  A batch needing more than ``STAGING_BLOCK_BYTES`` (unusually long keys)
    gets a block of its own, registered for that batch only.
    """

    def __init__(self, host: HostMemory) -> None:
        self._host = host
        self._lock = threading.Lock()
        self._free: list[mmap.mmap] = []

    @contextmanager
    def lease(self, lengths: Sequence[int]) -> Iterator[list[memoryview]]:
        """Views of ``lengths`` bytes each, valid until the ``with`` block ends."""
        total = max(1, sum(lengths))
        block = self._take(total)
        whole = memoryview(block)
        views: list[memoryview] = []
        offset = 0
        # Anonymous mmap memory is page-aligned and, as the lengths are multiples of 4096,
        # so is every slot: usable with O_DIRECT.
        for length in lengths:
            views.append(whole[offset : offset + length])
            offset += length
        try:
            yield views
        finally:
            for view in views:
                view.release()
            whole.release()
            if len(block) == STAGING_BLOCK_BYTES:
                with self._lock:
                    self._free.append(block)
            else:
                block.close()

    def _take(self, size: int) -> mmap.mmap:
        if size > STAGING_BLOCK_BYTES:
            return mmap.mmap(-1, size)
        with self._lock:
            if self._free:
                return self._free.pop()
        block = mmap.mmap(-1, STAGING_BLOCK_BYTES)
        # The block stays mapped for the adapter's lifetime (its views are released after
        # every batch, so nothing pins it); the host deregisters it when the adapter ends.
        with memoryview(block) as view:
            self._host.pin(view)
        return block


def _places(items: list[_Pending]) -> Locator:
    """Where each item's payload goes in its file: after the header."""

    def locate(position: int, _address: int) -> StorageRow:
        item = items[position]
        return item.offset, item.length, item.fd

    return locate


def _header_places(items: list[_Pending]) -> Locator:
    """Each item's header: the start of its file."""

    def locate(position: int, _address: int) -> StorageRow:
        return 0, items[position].offset, items[position].fd

    return locate


def _header_and_payload_places(items: list[_Pending]) -> Locator:
    """Two descriptors per item, header then payload, for one READ request."""

    def locate(position: int, _address: int) -> StorageRow:
        item = items[position // 2]
        if position % 2 == 0:
            return 0, item.offset, item.fd
        return item.offset, item.length, item.fd

    return locate


def _groups(items: list[_Pending]) -> Iterator[list[_Pending]]:
    """Consecutive groups of about PIPELINE_GROUP_BYTES each."""
    group: list[_Pending] = []
    size = 0
    for item in items:
        group.append(item)
        size += item.length
        if size >= PIPELINE_GROUP_BYTES:
            yield group
            group, size = [], 0
    if group:
        yield group


class RecordFiles:
    """Batched reads and writes of record files for one adapter."""

    def __init__(
        self,
        runtime: NixlRuntime,
        transfer: BatchTransfer,
        files: LocalFiles,
        context: BackendContext,
        *,
        direct_io: bool,
        plain_reads: bool = False,
    ) -> None:
        self._runtime = runtime
        self._transfer = transfer
        self._files = files
        self._layout = files.layout
        self._direct_io = direct_io
        self._context = context
        self._staging = HeaderStaging(transfer.host)
        self._sizes = HeaderSizes(
            lambda key, payload: context.record_header(key, payload, align=HEADER_ALIGN)
        )
        self._failures = WriteFailures(context.name, files.layout.root, context.count)
        self._can_reserve = True
        # Checksums of one batch run on one helper thread, overlapping that batch's I/O.
        # Two threads so that a load's verifier, which lives as long as its batch, never
        # makes a concurrent load wait for its own checksum thread.
        self._helper = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"nixl-{context.name}-checksum")
        # The inboxes of loads being verified: a close ends their verifiers (see close).
        self._inboxes: set[SimpleQueue[tuple[list[_Pending], list[bool]] | None]] = set()
        self._inboxes_lock = threading.Lock()
        self._closing = False
        # A store's checksums are write-back work and take the write-back threads' priority
        # (l2/background.py).  They get a thread of their own: a pool thread inherits the
        # priority of the thread that started it, so a shared one started by an idle-class
        # store thread stayed idle-class for good -- for the loads it verified later too,
        # and while write-back was hurried the store waited on a checksum thread still idle.
        self._store_helper = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix=f"nixl-{context.name}-store-checksum",
            initializer=self._join_write_back,
        )
        self._store_helper_tids: list[int] = []
        # Buffered loads on the POSIX backend: preadv, checksummed piece by piece.
        self._plain = PlainReads(context, files, self.header_length) if plain_reads else None

    def _join_write_back(self) -> None:
        self._store_helper_tids.append(threading.get_native_id())
        WRITE_BACK.enter()

    def close(self) -> None:
        # Core closes the backend once its close deadline passed, even while a call is
        # still stuck in storage (a hung mount): nothing here may wait for that call.  A
        # stuck load's verifier waits for groups that may never come: it is told to stop
        # after the groups already read (the others are not loaded).  The helpers are
        # still waited for -- checksums of bytes in L1, which must not be unmapped under
        # them -- as that is bounded work, and none is left blocked at the process's exit.
        with self._inboxes_lock:
            self._closing = True
            for inbox in self._inboxes:
                inbox.put(None)
        self._helper.shutdown(wait=True)
        self._store_helper.shutdown(wait=True)
        WRITE_BACK.forget(self._store_helper_tids)
        if self._plain is not None:
            self._plain.close()

    def header_length(self, key: ObjectKey) -> int:
        """Header size of ``key``'s record: its key, layout and serde chain padded to 4096.

        Keys and layouts are bounded well below a block, so the padded length depends on
        the key's encoded length only; a header that came out longer is refused when it
        is written, never read at the wrong offset.
        """
        return self._sizes.length(key)

    def _register(self, rows: list[StorageRow]) -> Registration:
        return self._runtime.register_files(
            self._transfer.backend, list(dict.fromkeys(row[2] for row in rows))
        )

    def _open_flags(self, base: int, buffer: memoryview, offset: int) -> int:
        return base | os.O_DIRECT if self._moved_by_device(buffer, offset) else base

    def _moved_by_device(self, buffer: memoryview, offset: int) -> bool:
        """Whether ``buffer`` goes to or from its file at ``offset`` with O_DIRECT: with
        ``use_direct_io``, when O_DIRECT's alignment rules allow (a payload of a
        size-changing serde seldom does); otherwise through the page cache, a copy."""
        return self._direct_io and direct_io_ok(buffer_address(buffer), buffer.nbytes, offset)

    # -- writes -----------------------------------------------------------------------------

    def write(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        """Write and publish each record; False where any step failed (nothing published).

        Records not yet published when the adapter starts closing fail (core counts them
        ``store_keys_failed``; one log line says why): see :meth:`_write_slice`."""
        results: list[bool] = []
        for start in range(0, len(keys), MAX_OPEN_FILES):
            if self._stopped():
                results += [False] * (len(keys) - start)
                break
            end = start + MAX_OPEN_FILES
            try:
                results += self._write_slice(keys[start:end], payloads[start:end])
            except Exception as exc:
                if not any(results):
                    raise  # nothing published: the batch fails as a whole
                # Earlier slices published their records: raising would report them not
                # stored, leaving them live on disk yet unaccounted until a restart.  They
                # are reported stored; this slice (which removed its temporary files) and
                # the rest are not.
                self._context.count("write_slice_failures")
                self._context.warn(
                    "write_slice",
                    "%d of %d keys not stored: writing a slice failed: %s",
                    len(keys) - len(results),
                    len(keys),
                    exc,
                )
                results += [False] * (len(keys) - len(results))
                break
        if self._stopped() and not all(results):
            log.info(
                "%s: %d of %d records of a store not written: the adapter is closing",
                self._context.name,
                results.count(False),
                len(results),
            )
        return results

    def _write_slice(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        """Once the adapter is closing nothing more is written and nothing published: core
        closes the backend past its deadline while a store is stuck (a hung mount), fails
        the store and hands its payload buffers back, and the adapter then releases its
        directory.  So the flag is asked before each temporary file is created (and before
        a vanished root would be created again), before each NIXL request and right before
        each rename (:meth:`LocalFiles.publish`); a record stopped there has its temporary
        file removed and fails."""
        stop = self._stopped
        pending: list[_Pending] = []
        results = [False] * len(keys)
        try:
            for index, (key, payload) in enumerate(zip(keys, payloads, strict=True)):
                if stop():
                    break
                item = self._open_temp(index, key, payload)
                if item is not None:
                    pending.append(item)
            if not pending or stop():
                return results
            # The header needs the payload's checksum, the payload's place does not (the
            # header's length is fixed by key and serde chain): checksums are computed on
            # the helper thread while NIXL moves the payloads, and headers go last.
            headers = self._store_helper.submit(self._encode_all, keys, payloads, pending)
            try:
                with self._payload_priority(payloads, pending):
                    moved = self._transfer.run(
                        "WRITE",
                        [payloads[item.index] for item in pending],
                        _places(pending),
                        self._register,
                        background=True,
                        stop=stop,
                    )
            finally:
                encoded = headers.result()
            complete: list[tuple[_Pending, bytes]] = []
            for item, ok, header in zip(pending, moved, encoded, strict=True):
                if not ok:
                    self._nixl_write_failed(keys[item.index], "payload")
                    continue
                if header is None:
                    continue  # explained where it failed
                if len(header) != item.offset:
                    self._context.header_too_long(keys[item.index], len(header), item.offset)
                    continue
                complete.append((item, header))
            for (item, _header), ok in zip(complete, self._write_headers(complete), strict=True):
                key = keys[item.index]
                if not ok:
                    self._nixl_write_failed(key, "header")
                    continue
                results[item.index] = self._close_written(item, key) and self._publish(item, key)
        finally:
            for item in pending:
                if item.fd >= 0:  # not published: its close cannot fail anything more
                    with suppress(OSError):
                        os.close(item.fd)
                if not results[item.index]:
                    self._files.remove_quietly(item.path)
        return results

    def _payload_priority(
        self, payloads: Sequence[memoryview], pending: list[_Pending]
    ) -> AbstractContextManager[None]:
        """The priority the payloads are posted at.  Buffered, NIXL copies them into the
        page cache in its posting call, without the GIL: idle-class (l2/background.py).
        With O_DIRECT the device moves them: what this thread runs is the Python that sets
        up, posts and polls a request per 2 MiB piece, holding the GIL -- and an idle-class
        thread holding the GIL is preempted by any thread that wakes on its core, the
        request threads then waiting for the GIL until that core is free again (the tail of
        lookups under write-back).  So it runs at nice 10 there, like the rest of its
        Python -- only when every payload of the batch goes with O_DIRECT: one that O_DIRECT
        cannot take (unaligned, as a compressing serde's output) is copied, even with
        ``use_direct_io``."""
        if all(self._moved_by_device(payloads[item.index], item.offset) for item in pending):
            return nullcontext()
        return WRITE_BACK.copying()

    def _nixl_write_failed(self, key: ObjectKey, part: str) -> None:
        """A record the storage failed through NIXL is counted and named like one whose
        open, reservation or close failed (``store_io_errors``); one stopped by the close
        is counted by :meth:`write` instead."""
        if not self._stopped():
            self._failures.failed(record_name(key), NixlTransferError(f"NIXL failed to write its {part}"))

    def _close_written(self, item: _Pending, key: ObjectKey) -> bool:
        """Close a complete temporary file before it is published: a network filesystem
        (NFS) reports write-back errors such as ENOSPC at the close, and they must fail the
        store while nothing is published yet."""
        fd, item.fd = item.fd, -1  # on Linux the descriptor is gone even when close fails
        try:
            os.close(fd)
        except OSError as exc:
            self._failures.failed(record_name(key), exc)
            return False
        return True

    def _write_headers(self, complete: list[tuple[_Pending, bytes]]) -> list[bool]:
        """Every header into the first block of its file, as one more NIXL request.

        One request rather than a ``pwrite`` per file: with O_DIRECT each small write would
        otherwise wait for the device in turn.  The staging block is page-aligned and every
        header a multiple of 4096 bytes, as O_DIRECT requires.
        """
        if not complete or self._stopped():
            return [False] * len(complete)  # closing: no staging block is taken either
        with self._staging.lease([len(header) for _item, header in complete]) as views:
            for view, (_item, header) in zip(views, complete, strict=True):
                view[:] = header
            items = [item for item, _header in complete]
            return self._transfer.run(
                "WRITE", views, _header_places(items), self._register, background=True, stop=self._stopped
            )

    def _encode_all(
        self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview], pending: list[_Pending]
    ) -> list[bytes | None]:
        # Only the checksums run idle-class: xxhash releases the GIL over a payload, while the
        # headers are encoded in Python, holding it -- preempted there by any thread waking on
        # its core, an idle-class thread kept the GIL from the request threads.
        with WRITE_BACK.copying():
            digests = [xxhash.xxh3_128_digest(payloads[item.index]) for item in pending]
        return [
            self._encode(keys[item.index], payloads[item.index], digest)
            for item, digest in zip(pending, digests, strict=True)
        ]

    def _encode(self, key: ObjectKey, payload: memoryview, digest: bytes) -> bytes | None:
        try:
            # Core fills in the L1 size, layout and serde chain of the key being stored.
            return self._context.record_header(key, payload, align=HEADER_ALIGN, digest=digest)
        except ValueError as exc:
            log.warning("cannot encode the record header of %s: %s", printable(record_name(key)), exc)
            return None

    def _open_temp(self, index: int, key: ObjectKey, payload: memoryview) -> _Pending | None:
        offset = self.header_length(key)
        try:
            fd, path = self._files.create_temp(key, self._open_flags(0, payload, offset), stop=self._stopped)
        except OSError as exc:
            if self._stopped():
                return None  # the root vanished as the adapter closed: logged by write
            self._failures.failed(record_name(key), exc)
            return None
        try:
            self._reserve(fd, offset + payload.nbytes)
        except OSError as exc:
            os.close(fd)
            self._files.remove_quietly(path)
            self._failures.failed(record_name(key), exc)
            return None
        return _Pending(index, fd, path, offset, payload.nbytes)

    def _reserve(self, fd: int, size: int) -> None:
        """Allocate the file's blocks now: ENOSPC here fails this record alone."""
        if not self._can_reserve:
            return
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if is_out_of_space(exc):
                raise
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                self._can_reserve = False  # this filesystem cannot: NIXL's own errors stand
                return
            raise

    def _publish(self, item: _Pending, key: ObjectKey) -> bool:
        try:
            # False: the adapter started closing; the caller removes the temporary file.
            return self._files.publish(key, item.path, stop=self._stopped)
        except OSError as exc:
            self._failures.failed(record_name(key), exc)
            return False

    # -- reads ------------------------------------------------------------------------------

    def read(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        """Fill each buffer with its key's verified payload; True where loaded.

        A record that does not verify is removed (``corrupt_records_removed``); one of
        another size or written with another serde chain is a miss that is kept.
        """
        if self._plain is not None:
            return self._plain.read(keys, buffers)  # one file open per read thread
        results: list[bool] = []
        for start in range(0, len(keys), MAX_OPEN_FILES):
            if self._stopped():
                # No file is opened (nor registered) once closing began: not loaded.
                results += [False] * (len(keys) - start)
                break
            results += self._read_slice(
                keys[start : start + MAX_OPEN_FILES], buffers[start : start + MAX_OPEN_FILES]
            )
        return results

    def _read_slice(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        results: list[bool] = [False] * len(keys)
        pending: list[_Pending] = []
        try:
            for index, (key, buffer) in enumerate(zip(keys, buffers, strict=True)):
                outcome = self._begin_read(index, key, buffer)
                if isinstance(outcome, _Pending):
                    pending.append(outcome)
            if not pending:
                return results
            with self._staging.lease([item.offset for item in pending]) as views:
                for item, view in zip(pending, views, strict=True):
                    item.header = view
                self._read_pipelined(keys, pending, buffers, results)
        finally:
            for item in pending:
                item.header = None
                os.close(item.fd)
        return results

    def _read_pipelined(
        self,
        keys: Sequence[ObjectKey],
        pending: list[_Pending],
        buffers: Sequence[memoryview],
        results: list[bool],
    ) -> None:
        """Read header and payload of every file, group by group, verifying as they land.

        This thread posts one NIXL request per group without waiting for verification;
        the helper thread verifies each group as soon as it is read.  Both release the GIL
        for their bulk work (NIXL's transfer call, xxhash over a buffer), so with a second
        core the checksum adds only the last group's verification to the batch's time.
        The files are registered once for the whole slice rather than per group.
        """
        # A file appears twice in the requests (header and payload); register it once.
        registration = self._runtime.register_files(self._transfer.backend, [item.fd for item in pending])
        inbox: SimpleQueue[tuple[list[_Pending], list[bool]] | None] = SimpleQueue()
        try:
            verifier = self._helper.submit(self._verify_stream, keys, inbox, buffers, results)
        except BaseException:
            # Closed meanwhile (no new helper work): the agent outlives the adapter, so the
            # files are not left registered with it.
            registration.release()
            raise
        with self._inboxes_lock:
            self._inboxes.add(inbox)
            if self._closing:
                inbox.put(None)
        try:
            for group in _groups(pending):
                if self._stopped():
                    # Closing while this load ran past core's close deadline: its buffers are
                    # no longer its own, and no later group is read into them (not loaded).
                    break
                targets: list[memoryview] = []
                for item in group:
                    assert item.header is not None
                    targets += [item.header, buffers[item.index]]
                moved = self._transfer.run(
                    "READ", targets, _header_and_payload_places(group), stop=self._stopped
                )
                inbox.put((group, moved))
        finally:
            inbox.put(None)
            try:
                verifier.result()
            finally:
                with self._inboxes_lock:
                    self._inboxes.discard(inbox)
                registration.release()

    def _verify_stream(
        self,
        keys: Sequence[ObjectKey],
        inbox: SimpleQueue[tuple[list[_Pending], list[bool]] | None],
        buffers: Sequence[memoryview],
        results: list[bool],
    ) -> None:
        while (work := inbox.get()) is not None:
            group, moved = work
            self._verify(keys, group, moved, buffers, results)

    def _verify(
        self,
        keys: Sequence[ObjectKey],
        group: list[_Pending],
        moved: list[bool],
        buffers: Sequence[memoryview],
        results: list[bool],
    ) -> None:
        for position, item in enumerate(group):
            if self._stopped():
                return  # the buffers may hold other objects' bytes: judged by nothing
            if not (moved[2 * position] and moved[2 * position + 1]):
                # The kernel failed the read, or the file changed under it: a miss, counted
                # as the plain reads count a failed read; the record is not judged.
                self._read_error("cannot read", item.path, "NIXL failed to read it")
                continue
            assert item.header is not None
            try:
                header = self._context.read_record_header(bytes(item.header), keys[item.index])
                if header is None:
                    continue  # intact, but of another serde chain: a miss that is kept
                if header.header_len != item.offset or header.payload_len != item.length:
                    raise RecordError(
                        f"record header says {header.header_len}+{header.payload_len} bytes, "
                        f"file holds {item.offset}+{item.length}"
                    )
                verify_payload(header, buffers[item.index])
                results[item.index] = True
            except RecordError as exc:
                if self._stopped():
                    return  # closing began under the check: the buffer proves nothing
                if not self._context.kept_record(keys[item.index], exc):  # another key's, a newer format's
                    self._files.discard(keys[item.index], item.identity, "corrupt_records_removed", str(exc))

    def _stopped(self) -> bool:
        """Whether the adapter started closing.  Core sets its closing flag first, fails
        the loads still running at its deadline (their L1 buffers go to other objects) and
        only then closes the backend: from the flag on, a load reads nothing more into its
        buffers and judges no record by them, and a store writes and publishes nothing
        more (:meth:`_write_slice`)."""
        return self._closing or self._context.closing

    def _begin_read(self, index: int, key: ObjectKey, buffer: memoryview) -> _Pending | None:
        path = self._layout.path_for(key)
        header_len = self.header_length(key)
        flags = self._open_flags(os.O_RDONLY | os.O_CLOEXEC, buffer, header_len)
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._read_error("cannot open", path, exc)
            return None
        identity = None
        try:
            stat = os.fstat(fd)
            identity = identity_of(stat)
            if stat.st_size == header_len + buffer.nbytes:
                return _Pending(index, fd, path, header_len, buffer.nbytes, identity=identity)
            self._explain_size(fd, key, header_len, stat.st_size, buffer.nbytes)
        except RecordError as exc:
            if not self._context.kept_record(key, exc):  # another key's, a newer format's: kept
                self._files.discard(key, identity, "corrupt_records_removed", str(exc))
        except OSError as exc:
            self._read_error("cannot read", path, exc)
        os.close(fd)
        return None

    def _read_error(self, what: str, path: str, exc: OSError | str) -> None:
        """A record file that cannot be opened or read: a miss, counted as the plain reads
        and local file stores count it; a failing disk fails every load alike, so a burst
        is one line."""
        self._context.count("load_read_errors")
        self._context.warn("load_read_error", "%s %s: %s", what, printable(path, 300), exc)

    def _explain_size(self, fd: int, key: ObjectKey, header_len: int, size: int, expected: int) -> bool:
        """A file of an unexpected size: another intact object (False) or damage (raises)."""
        header = self._read_header(fd, key, header_len)
        if header is None:
            return False  # of another serde chain: kept
        if header.header_len + header.payload_len != size:
            raise RecordError(
                f"record file is {size} bytes, header says {header.header_len + header.payload_len}"
            )
        # Header and payload told apart: a record whose header length differs (another
        # layout string) may hold a payload of the very size a load expected.  Another
        # writer replaced it since the lookup (another chunk size): counted under the name
        # the other adapters count it, a burst told in one line.
        self._context.count("load_size_changed")
        self._context.warn(
            "size_changed",
            "%s is a record of %d bytes (header %d, payload %d), a load expected %d (header %d, "
            "payload %d) (replaced since the lookup): a miss, kept",
            printable(record_name(key)),
            size,
            header.header_len,
            header.payload_len,
            header_len + expected,
            header_len,
            expected,
        )
        return False

    def size_from_header(self, key: ObjectKey) -> ObjectSize | None:
        """Stored and L1 size from ``key``'s verified header; None when there is no
        file, the record was written with another serde chain, or it is damaged
        (then it is removed)."""
        try:
            fd = os.open(self._layout.path_for(key), os.O_RDONLY | os.O_CLOEXEC)
        except ABSENT_FILE_ERRORS:
            return None  # removed since its stat (other errors fail the lookup batch)
        identity = None
        try:
            identity = identity_of(os.fstat(fd))
            header = self._read_header(fd, key, self.header_length(key))
        except RecordError as exc:
            if not self._context.kept_record(key, exc):  # another key's, a newer format's: kept
                self._files.discard(key, identity, "corrupt_records_removed", str(exc))
            return None
        finally:
            os.close(fd)
        return None if header is None else ObjectSize(header.payload_len, header.l1_size)

    def _read_header(self, fd: int, key: ObjectKey, header_len: int) -> RecordHeader | None:
        # Page-aligned memory works for O_DIRECT and buffered descriptors alike.
        length = -(-header_len // HEADER_ALIGN) * HEADER_ALIGN
        with mmap.mmap(-1, length) as block:
            got = os.preadv(fd, [block], 0)
            data = block[:got]  # a copy, so no view pins the mapping while it closes
        return self._context.read_record_header(data, key)
