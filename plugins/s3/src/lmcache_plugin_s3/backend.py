"""The ``s3`` backend: the batch methods core's adapter calls, as coroutines on the
adapter's event loop.

Each key of a batch is its own request, all of a batch in flight together (at most
``max_inflight`` per adapter).  Results are per key; a key whose request failed is a
failure (False, or None for a lookup), counted and logged once a minute.  When every
request of a batch failed, the batch raises: core counts a backend error, and its circuit
breaker (this backend declares itself ``remote``) stops calling a store that keeps
failing until ``ping`` finds it answering.  A store, load or delete some of whose
requests failed raises ``PartialFailure`` with its per-key answer: core accounts the keys
done and counts the call as failed, so a service failing part of every batch is seen by
the breaker too.  Lookups and loads always ask the bucket, so a
chunk another server stored is found and one it deleted is a miss.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, Literal, TypeVar

from lmcache_plugin_s3.client import (
    DAMAGED_UPLOAD,
    S3Client,
    S3RequestError,
    check_bucket,
    describe,
    error_code,
    is_bare_not_found,
    is_missing_bucket,
    is_missing_object,
)
from lmcache_plugin_s3.config import S3Config
from lmcache_plugin_s3.records import (
    HEADER_BYTES,
    MAX_PUT_BYTES,
    ObjectNames,
    ShortBody,
    crc32_checksum,
    header_from_metadata,
    header_metadata,
    read_exactly,
    total_size,
)
from lmcache_tiers.plugin import (
    PREFIX_SIZE,
    BackendContext,
    KeptByDelete,
    ObjectKey,
    ObjectSize,
    PartialFailure,
    RecordError,
    RecordHeader,
    RecordVersionError,
    copy_into,
    header_length,
    keeps_unlisted,
    record_key,
    verify_payload,
)

log = logging.getLogger("lmcache_plugin_s3")
T = TypeVar("T")
#: keys per DeleteObjects request (the S3 API's limit)
_DELETE_BATCH = 1000
#: objects per listing page (the S3 API's limit)
_LIST_PAGE = 1000
_PROGRESS_EVERY_S = 10.0
#: what the circuit breaker's probe asks for (never stored: not a key codec name)
_PROBE_NAME = "lmcache-tiers-probe"
#: what S3 answers a read of a missing object by an identity without ``ListBucket``
_NO_LIST_PERMISSION = "AccessDenied"


class _ReadTheRecord(Exception):
    """A lookup's HEAD found no usable header copy: the record's own header decides."""


class _Damaged(Exception):
    """The object under a key's name is not a readable record of it: remove it."""


class _Replaced(Exception):
    """The object a read found damaged was replaced before it was read again."""


def _check_size(total: int, header: RecordHeader) -> None:
    """A record is exactly its header and payload: a longer or shorter object is damaged."""
    expected = header.header_len + header.payload_len
    if total != expected:
        raise _Damaged(f"the object is {total} bytes, its header says {expected}")


class _Unlisted(enum.Enum):
    """Why the listing leaves an object out."""

    #: not a record of this cache (counted ``listing_foreign_objects``)
    FOREIGN = "foreign"
    #: a digest-named record judged by its header, and counted there: one of a format
    #: version this code does not read (a newer server sharing the bucket wrote it and
    #: reads it: kept, ``record_version_unknown``), a damaged or misnamed one (removed,
    #: ``corrupt_records_removed``), one whose header could not be read (kept,
    #: ``listing_read_errors``), or one gone since the page was listed
    JUDGED = "judged"


def _unchanged(name: str, etag: str) -> dict[str, str]:
    """A DeleteObjects entry removing ``name`` only while it is the object read as ``etag``
    (a store that ignores the condition removes whatever is there, as a plain delete)."""
    return {"Key": name, "ETag": etag}


def _partly_done(op: str, done: list[bool], failures: int) -> list[bool]:
    """``done``, or -- when ``failures`` of the batch's requests failed (counted already)
    while the others were answered -- raised as the answer of a failed call: core accounts
    the keys done, and its circuit breaker sees the failure a returned answer would hide."""
    if not failures:
        return done
    raise PartialFailure(done, f"{op}: {failures} of {len(done)} requests failed")


def _copy_naming_its_key(answer: dict[str, Any]) -> bytes | None:
    """The header copy in a HEAD's metadata when it is an intact header (of whichever key);
    None when there is none, or it says nothing (then the record's own header tells)."""
    try:
        copy = header_from_metadata(answer)
        if copy is not None:
            record_key(copy)
    except (ValueError, RecordError):
        return None
    return copy


class S3Backend:
    """Records in ``s3://<bucket>/<prefix>/``, one object per key."""

    #: behind core's circuit breaker: an unreachable store is asked only by its probe
    remote = True

    def __init__(self, config: S3Config, context: BackendContext) -> None:
        self.config = config
        self.context = context
        self.name = context.name
        #: batch calls in flight; their requests share the client's max_inflight slots
        self.concurrency = config.max_inflight
        self.names = ObjectNames(config.prefix)
        #: keys a delete found another key's record (or a newer format's) under, counted
        #: and logged then: core asks next whether the key is absent, and that lookup
        #: does not count it again
        self._deletes = KeptByDelete(context)
        self.client = S3Client(config, context.name)
        self._loop: asyncio.AbstractEventLoop | None = None
        #: the one check in flight of whether the bucket exists, shared by the lookups
        #: whose HEAD answered a bare 404 meanwhile
        self._bucket_check: asyncio.Future[None] | None = None
        self._answered_at_start = check_bucket(config, context.name)

    # -- lifecycle ---------------------------------------------------------------------------

    async def open(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self.client.open(announce=False)  # check_bucket said where the credentials come from

    def interrupt(self) -> None:
        if self._loop is not None:
            self.client.interrupt(self._loop)

    async def close(self) -> None:
        await self.client.close()

    async def ping(self) -> None:
        """The circuit breaker's probe: the bucket answers (raises otherwise).

        It asks for a name under the prefix that is never stored: "no such key" is the
        answer.  So is a refusal (AccessDenied), which an identity without ``ListBucket``
        gets for a missing key: an identity scoped to its prefix (object permissions
        only) may neither ``HeadBucket`` nor list, and its probe must still find the
        service back, or the circuit would never close again.  Any other refusal --
        rejected credentials, a clock the service finds skewed (``RequestTimeTooSkewed``)
        -- is refused to every real request too: it fails the probe, counted
        (``probe_refusals``) and logged with its code.  So do a missing bucket (counted
        ``bucket_missing``), a 5xx and no answer.
        """
        try:
            await self._ask_for_probe_name()
        except Exception as exc:
            if is_missing_bucket(exc):
                self._bucket_missing(1)
            elif isinstance(exc, PermissionError):
                self.context.count("probe_refusals")
                self.context.warn(
                    "probe_refused",
                    "the circuit breaker's probe was refused (%s): every request would be; "
                    "the circuit stays open",
                    describe(exc),
                )
            raise

    async def _ask_for_probe_name(self) -> None:
        """Ask the bucket for a name under the prefix that is never stored; return when it
        answered (see :meth:`ping`), raise otherwise."""
        try:
            answer = await self.client.call(
                "get_object", Key=self.names.folder + _PROBE_NAME, Range="bytes=0-0"
            )
        except Exception as exc:
            code = error_code(exc)
            empty = code == "InvalidRange"  # something stored an empty object there
            if is_missing_object(exc) or code == _NO_LIST_PERMISSION or empty:
                self.client.bucket_answered()
                return
            raise
        answer["Body"].close()

    async def _bucket_exists(self) -> None:
        """Rule out a missing bucket behind a lookup's or a delete's bare 404 -- a HEAD's
        answer has no body to name "no such key" or "no such bucket" in -- by an answer of
        the last few seconds that proved the bucket exists, else by asking for the probe's
        name (one request shared by the calls waiting on it); raises when the bucket is
        missing, so the call fails (counted ``bucket_missing``) rather than reading as
        absent."""
        if self.client.bucket_vouched():
            return
        if self._bucket_check is None or self._bucket_check.done():
            self._bucket_check = asyncio.ensure_future(self._ask_for_probe_name())
        await asyncio.shield(self._bucket_check)

    def _bucket_missing(self, requests: int) -> None:
        self.context.count("bucket_missing", requests)
        self.context.warn(
            "bucket_missing",
            "bucket %r does not exist at %s (%d requests failed for it): every request fails, "
            "and the circuit opens, until it is created",
            self.config.bucket,
            self.client.endpoint,
            requests,
        )

    def capacity(self) -> int | None:
        return int(self.config.max_capacity_gb * (1 << 30)) or None

    def stats(self) -> dict[str, int]:
        return {"inflight_requests": self.client.inflight, "max_inflight": self.config.max_inflight}

    # -- the batch methods -----------------------------------------------------------------

    async def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        results, failures = await self._each(
            "store", [self._put(key, data) for key, data in zip(keys, payloads, strict=True)]
        )
        return _partly_done("store", [bool(result) for result in results], failures)

    async def contains_many(self, keys: Sequence[ObjectKey]) -> list[ObjectSize | None]:
        # A lookup answers None for "absent", and core releases the accounted bytes of an
        # absent key: a request that failed must not read as one, so it fails the batch
        # (every key a miss, nothing released).
        answer = await self._each("lookup", [self._lookup(key) for key in keys], whole=True)
        return answer[0]  # (``whole``: none failed)

    async def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        results, failures = await self._each(
            "load", [self._load(key, buffer) for key, buffer in zip(keys, buffers, strict=True)]
        )
        return _partly_done("load", [bool(result) for result in results], failures)

    async def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        names = [self.names.of(key) for key in keys]
        judged, failures = await self._each(
            "delete", [self._deletable(key, name) for key, name in zip(keys, names, strict=True)]
        )
        doomed = {name: verdict for name, verdict in zip(names, judged, strict=True) if verdict}
        kept: set[str] = set()
        batches = list(doomed.items())
        for start in range(0, len(batches), _DELETE_BATCH):
            batch = dict(batches[start : start + _DELETE_BATCH])
            try:
                answer = await self.client.call(
                    "delete_objects",
                    Delete={
                        "Objects": [_unchanged(name, etag) for name, etag in batch.items()],
                        "Quiet": True,
                    },
                )
            except Exception as exc:
                if len(batch) == len(names):
                    raise S3RequestError(f"delete of {len(batch)} objects failed: {describe(exc)}") from exc
                self._failed("delete", len(batch), exc)
                failures += len(batch)
                kept.update(batch)
                continue
            not_removed, refused = self._not_removed(answer.get("Errors") or [])
            failures += refused
            kept.update(not_removed)
        return _partly_done("delete", [name in doomed and name not in kept for name in names], failures)

    def _not_removed(self, errors: list[dict[str, Any]]) -> tuple[set[str], int]:
        """The names a DeleteObjects answer lists as not removed, and how many of them
        failed (refused, not replaced), each counted: one
        replaced since it was judged (its ETag no longer the one read) is another
        server's write, kept (``delete_replaced_before_removal``); the rest were refused.
        One gone since it was judged (a conditional removal of a missing object is "no
        such key" on some services) was removed by another server: deleted, as asked."""
        errors = [error for error in errors if error.get("Code") != "NoSuchKey"]
        replaced = [error for error in errors if error.get("Code") == "PreconditionFailed"]
        refused = [error for error in errors if error.get("Code") != "PreconditionFailed"]
        if replaced:
            self.context.count("delete_replaced_before_removal", len(replaced))
            self.context.warn(
                "delete_replaced",
                "%d objects were replaced between the delete's check and their removal, e.g. %s; "
                "the new objects are kept",
                len(replaced),
                replaced[0].get("Key"),
            )
        if refused:
            self._failed(
                "delete",
                len(refused),
                S3RequestError(f"{refused[0].get('Code')}: {refused[0].get('Message')}"),
            )
        return {str(error.get("Key")) for error in errors}, len(refused)

    async def list_keys(self) -> AsyncIterator[tuple[ObjectKey, int]]:
        """Every record under the prefix with its payload size, one listing page at a time."""
        if not self._answered_at_start:
            # Waiting for a silent store here would hold up the server's start; what the
            # bucket holds is accounted as lookups find it instead.
            raise S3RequestError(f"{self.client.endpoint} did not answer at start-up; no listing")
        token: str | None = None
        listed = foreign = 0
        started = last_progress = time.monotonic()
        while True:
            page = await self.client.call(
                "list_objects_v2",
                Prefix=self.names.folder,
                Delimiter="/",
                MaxKeys=_LIST_PAGE,
                **({"ContinuationToken": token} if token else {}),
            )
            for item in page.get("Contents") or []:
                entry = await self._listed(str(item["Key"]), int(item["Size"]))
                if isinstance(entry, _Unlisted):
                    foreign += entry is _Unlisted.FOREIGN
                    continue
                listed += 1
                yield entry
            if not page.get("IsTruncated"):
                break
            token = page.get("NextContinuationToken")
            if not token:
                # Ending here would take a partial listing for the whole: core would
                # account part of the bucket as all of it.  A failed listing says so.
                raise S3RequestError(
                    f"listing s3://{self.config.bucket}/{self.names.folder}: a truncated page "
                    f"without a continuation token after {listed} records"
                )
            if time.monotonic() - last_progress >= _PROGRESS_EVERY_S:
                last_progress = time.monotonic()
                log.info(
                    "%s: listing s3://%s/%s: %d records so far",
                    self.name,
                    self.config.bucket,
                    self.names.folder,
                    listed,
                )
        if foreign:
            self.context.count("listing_foreign_objects", foreign)
            log.warning(
                "%s: %d objects under s3://%s/%s are not records of this cache; ignored",
                self.name,
                foreign,
                self.config.bucket,
                self.names.folder,
            )
        log.info("%s: listed %d records in %.1f s", self.name, listed, time.monotonic() - started)

    # -- one key ---------------------------------------------------------------------------

    async def _put(self, key: ObjectKey, payload: memoryview) -> bool:
        header = self.context.record_header(key, payload, align=HEADER_BYTES)
        if len(header) != HEADER_BYTES:
            self.context.count("store_header_too_large")
            self.context.warn(
                "header",
                "record header of %s is %d bytes, over %d; not stored",
                key.file_stem(),
                len(header),
                HEADER_BYTES,
            )
            return False
        if HEADER_BYTES + payload.nbytes > MAX_PUT_BYTES:
            self.context.count("store_object_too_large")
            self.context.warn(
                "too_large",
                "%s is %d bytes, over one PUT's 5 GiB; not stored",
                key.file_stem(),
                payload.nbytes,
            )
            return False
        name = self.names.of(key)

        async def put() -> None:
            # Joined inside the request slot, so at most max_inflight bodies exist at once.
            body = b"".join((header, payload))
            copy = header_metadata(header)
            arguments = {
                "Key": name,
                "Body": body,
                "ChecksumCRC32": crc32_checksum(body),
                **({"Metadata": copy} if copy else {}),
            }
            try:
                await self.client.request("put_object", **arguments)
            except Exception as exc:
                if error_code(exc) not in DAMAGED_UPLOAD:
                    raise
                # Refused by the store: nothing was stored.  Damage on the way is rarely
                # repeated, so the body is sent once more; a second refusal fails the key.
                self.context.count("store_damaged_in_transit")
                self.context.warn(
                    "damaged_in_transit",
                    "the store refused %s: it arrived damaged (%s); sent once more",
                    name,
                    describe(exc),
                )
                await self.client.request("put_object", **arguments)

        await self.client.bounded(put)
        return True

    async def _lookup(self, key: ObjectKey) -> ObjectSize | None:
        name = self.names.of(key)
        try:
            answer = await self.client.call("head_object", Key=name)
        except Exception as exc:
            if is_missing_object(exc):
                if is_bare_not_found(exc):
                    await self._bucket_exists()
                return None
            raise
        try:
            return self._size_in_copy(key, answer)
        except _ReadTheRecord:
            return await self._lookup_in_record(key, name, answer.get("ETag"))

    def _size_in_copy(self, key: ObjectKey, answer: dict[str, Any]) -> ObjectSize | None:
        """What the header copy in a HEAD's metadata says of ``key``: its size, or None for
        a miss that is kept (another serde chain, a newer format).  :class:`_ReadTheRecord`
        when there is no copy or it does not agree with the object."""
        try:
            slot = header_from_metadata(answer)
            if slot is None:
                raise _ReadTheRecord
            header = self.context.read_record_header(slot, key)
        except RecordVersionError as exc:  # a newer server's: kept, whatever else the copy says
            self._deletes.kept_record(key, exc)
            return None
        except (ValueError, RecordError) as exc:
            self._copy_unusable(key, str(exc))
            raise _ReadTheRecord from exc
        if header is None:
            return None
        try:
            _check_size(int(answer.get("ContentLength", -1)), header)
        except _Damaged as exc:  # not said of the object: only its own header may say that
            self._copy_unusable(key, str(exc))
            raise _ReadTheRecord from exc
        return ObjectSize(header.payload_len, header.l1_size)

    def _copy_unusable(self, key: ObjectKey, why: str) -> None:
        self.context.count("header_copy_unusable")
        self.context.warn(
            "header_copy",
            "%s: the header copy in its metadata is unusable (%s); its record is read",
            key.file_stem(),
            why,
        )

    async def _lookup_in_record(self, key: ObjectKey, name: str, head_etag: str | None) -> ObjectSize | None:
        """A lookup by the record's own header (one ranged GET; a second one, of the same
        object, when the first finds damage).  ``head_etag``: the ETag the lookup's HEAD
        saw, what an empty object's removal is conditional on (the refused ranged GET of
        an empty object names none)."""
        try:
            data, total, etag = await self.client.bounded(lambda: self._first_bytes(name))
        except Exception as exc:
            if is_missing_object(exc):
                return None
            if error_code(exc) == "InvalidRange":  # an empty object: no header at all
                # Conditional on the object the HEAD saw: a record stored there since is kept.
                await self._remove_damaged(name, "the object is empty", head_etag, key)
                return None
            raise
        etag = etag or head_etag
        try:
            return self._size_in_record(key, data, total)
        except _Damaged as exc:
            first_damage = str(exc)
        try:
            data, total = await self._read_slot_again(name, etag)
        except _Replaced as exc:
            self._replaced_before_reread("lookup", name, first_damage)
            # Neither absent (core would release what the new object holds) nor judged:
            # the lookup fails, a miss for now.
            raise S3RequestError(
                f"lookup of {key.file_stem()}: the object was replaced while it was read"
            ) from exc
        except Exception as exc:
            if is_missing_object(exc):
                return None
            raise
        try:
            size = self._size_in_record(key, data, total)
        except _Damaged as exc:
            await self._remove_damaged(name, str(exc), etag, key)
            return None
        self._damage_not_repeated("lookup", name, first_damage)
        return size

    def _size_in_record(self, key: ObjectKey, slot: bytes, total: int) -> ObjectSize | None:
        """What a record's own header slot says of ``key``: its size, or None for a miss
        that is kept; :class:`_Damaged` for the rest."""
        header = self._header(key, slot)
        if header is None:
            return None
        _check_size(total, header)
        return ObjectSize(header.payload_len, header.l1_size)

    async def _read_slot_again(self, name: str, etag: str | None) -> tuple[bytes, int]:
        """The header slot of ``name`` and the object's size, read again after a read of
        it found damage, only while it is the object read as ``etag``: a read can be
        damaged on the way (a faulty link or middlebox, which plain HTTP has only TCP's
        checksum against) while the object in the store is intact, and only damage found
        again has an object removed.  :class:`_Replaced` when it was replaced since."""
        try:
            data, total, _etag = await self.client.bounded(lambda: self._first_bytes(name, if_match=etag))
        except Exception as exc:
            if error_code(exc) == "PreconditionFailed":
                raise _Replaced from exc
            raise
        return data, total

    def _damage_not_repeated(self, op: str, name: str, damage: str) -> None:
        self.context.count("damage_not_repeated")
        self.context.warn(
            "damage_not_repeated",
            "a %s's read of s3://%s/%s found damage (%s) that a second read of the same object "
            "did not: damaged on the way, not in the store; the second read is used, the object kept",
            op,
            self.config.bucket,
            name,
            damage,
        )

    def _replaced_before_reread(self, op: str, name: str, damage: str) -> None:
        self.context.count("replaced_before_reread")
        self.context.warn(
            "replaced_before_reread",
            "a %s's read of s3://%s/%s found damage (%s), and the object was replaced before it "
            "was read again; the new object is kept",
            op,
            self.config.bucket,
            name,
            damage,
        )

    async def _load(self, key: ObjectKey, buffer: memoryview) -> bool:
        """Read ``key``'s record into ``buffer``.  Damage is judged by a second read of the
        same object (``If-Match`` the ETag of the first) before the object is removed: a
        read can be damaged on the way -- a faulty link or middlebox, which plain HTTP has
        only TCP's checksum against -- while the object in the store is an intact,
        acknowledged write.  A second read that finds it intact loads it (counted
        ``damage_not_repeated``); one that finds it damaged again has it removed."""
        name = self.names.of(key)
        #: the ETag of the object read: a damaged one is removed only if it is still that one
        read: dict[str, str | None] = {}
        try:
            return await self._read_into(key, name, buffer, read)
        except _Damaged as exc:
            first_damage = str(exc)
        try:
            loaded = await self._read_into(key, name, buffer, read, if_match=read.get("etag"))
        except _Damaged as exc:
            await self._remove_damaged(name, str(exc), read.get("etag"), key)
            return False
        except Exception as exc:
            if error_code(exc) != "PreconditionFailed":
                raise
            # The object judged is gone and a miss is safe; the new one is judged when read.
            self._replaced_before_reread("load", name, first_damage)
            return False
        if loaded:
            self._damage_not_repeated("load", name, first_damage)
        return loaded

    async def _read_into(
        self,
        key: ObjectKey,
        name: str,
        buffer: memoryview,
        read: dict[str, str | None],
        if_match: str | None = None,
    ) -> bool:
        """One GET of ``name`` into ``buffer``: True once the payload is there, verified;
        False for a miss (gone, kept, replaced by one of another length); :class:`_Damaged`
        for an object that is not a readable record of ``key`` as read."""

        async def into_buffer() -> bool:
            condition = {"IfMatch": if_match} if if_match else {}
            answer = await self.client.request("get_object", Key=name, **condition)
            read["etag"] = answer.get("ETag")
            body = answer["Body"]
            length = int(answer["ContentLength"])
            try:
                if length < PREFIX_SIZE:
                    raise _Damaged(f"the object is {length} bytes, shorter than a record header")
                prefix = await read_exactly(body, PREFIX_SIZE)
                try:
                    header_len = header_length(prefix)
                except RecordError as exc:
                    if self._deletes.kept_record(key, exc):
                        return False
                    raise _Damaged(str(exc)) from exc
                if header_len > length:
                    raise _Damaged(f"the object is {length} bytes, its header alone {header_len}")
                header = self._header(key, prefix + await read_exactly(body, header_len - PREFIX_SIZE))
                if header is None:
                    return False
                if header.payload_len != buffer.nbytes:
                    # Replaced by another writer since the lookup: not these bytes, no copy.
                    self.context.count("load_size_changed")
                    self.context.warn(
                        "size_changed",
                        "%s holds %d payload bytes now, the load buffer %d (replaced since the "
                        "lookup); a miss",
                        key.file_stem(),
                        header.payload_len,
                        buffer.nbytes,
                    )
                    return False
                _check_size(length, header)
                # The rest is exactly the payload now (the length was checked): one read.
                payload = await body.read()
                if len(payload) != buffer.nbytes:
                    raise ShortBody(f"the body ended after {len(payload)} of {buffer.nbytes} payload bytes")
                copy_into(buffer, payload)
                # Dropped before the check: damage found raises through this frame, and the
                # exception's traceback keeps its locals alive -- in a reference cycle with
                # the request's task, until the cycle collector runs -- so the payload would
                # still be held through the second read, twice the load's bytes at once.
                del payload
            finally:
                body.close()
            try:
                verify_payload(header, buffer)
            except RecordError as exc:
                raise _Damaged(str(exc)) from exc
            return True

        try:
            return await self.client.bounded(into_buffer)
        except ShortBody as exc:
            raise S3RequestError(f"load of {key.file_stem()}: {exc}") from exc
        except _Damaged:
            raise
        except Exception as exc:
            if is_missing_object(exc):  # deleted since the lookup, e.g. by another server
                return False
            raise

    async def _deletable(self, key: ObjectKey, name: str) -> str | Literal[False]:
        """Whether ``name`` holds an object a delete of ``key`` removes -- there, and not an
        intact record of another key -- as the ETag of the object judged (the removal is
        conditional on it), False for none to remove.  The
        listing reads names only, so it accounts, e.g., an fs adapter's record of a salted
        key as this codec's key with ".bin" added to its salt; the L2 eviction's delete of
        that key must leave the other writer's object.  A record of a format version this
        code does not read is kept too: a newer server sharing the bucket wrote it and
        reads it (lookups keep it as well).  The header copy of the HEAD tells; without
        one, the record's own header does.  An object read without an ETag is kept,
        counted (``delete_kept_without_etag``): its removal could only be unconditional,
        and take a record another server stored there since.  A bare 404 is checked as a
        lookup's is: in a missing bucket the delete fails, counted (``bucket_missing``),
        rather than reading as nothing to remove."""
        try:
            answer = await self.client.call("head_object", Key=name)
        except Exception as exc:
            if is_missing_object(exc):
                if is_bare_not_found(exc):
                    await self._bucket_exists()
                return False
            raise
        etag = answer.get("ETag")
        copy = _copy_naming_its_key(answer)
        if copy is not None:
            slot = copy
        else:  # no usable copy: the record's own header tells
            try:
                slot, _total, read_etag = await self.client.bounded(lambda: self._first_bytes(name))
            except Exception as exc:
                if is_missing_object(exc):
                    return False
                if error_code(exc) == "InvalidRange":  # an empty object: no record to keep
                    return self._removable_as(name, etag)
                raise
            # The HEAD's ETag when the read named none: should the object have changed in
            # between, the removal's condition fails and the new object is kept.
            etag = read_etag or etag
        if self._deletes.keeps(key, slot):
            return False
        return self._removable_as(name, etag)

    def _removable_as(self, name: str, etag: str | None) -> str | Literal[False]:
        """The ETag a delete's removal of ``name`` is conditional on; False (kept, counted,
        the delete fails) when the service named none."""
        if etag:
            return etag
        self.context.count("delete_kept_without_etag")
        self.context.warn(
            "delete_no_etag",
            "%s was read without an ETag: its removal could take another server's record "
            "stored there since; kept, the delete fails",
            name,
        )
        return False

    async def _listed(self, name: str, size: int) -> tuple[ObjectKey, int] | _Unlisted:
        if size < HEADER_BYTES:
            return _Unlisted.FOREIGN
        key: ObjectKey | _Unlisted | None = self.names.key_of(name)
        if key is None and self.names.is_digest(name):
            key = await self._key_in_header(name)
        if key is None:
            return _Unlisted.FOREIGN
        return key if isinstance(key, _Unlisted) else (key, size - HEADER_BYTES)

    async def _key_in_header(self, name: str) -> ObjectKey | _Unlisted:
        """The key of a digest-named object, from its header (checked against the name),
        judged as the file stores' listings judge one: no lookup can reach a record whose
        header does not tell its key, so a damaged one is removed (if it is still the
        object read, and a second read of it finds the damage too) and counted as damage,
        and so is one whose header names a key whose object has another name; a newer
        format's is kept; a failed read says nothing about the object, which stays
        (``listing_read_errors``)."""
        try:
            data, _total, etag = await self.client.bounded(lambda: self._first_bytes(name))
        except Exception as exc:
            return self._unreadable_listed(name, exc)
        try:
            return self._key_in_slot(name, data)
        except _Damaged as exc:
            first_damage = str(exc)
        try:
            data, _total = await self._read_slot_again(name, etag)
        except _Replaced:
            # Not listed: the new object is accounted when a lookup finds it.
            self._replaced_before_reread("listing", name, first_damage)
            return _Unlisted.JUDGED
        except Exception as exc:
            return self._unreadable_listed(name, exc)
        try:
            key = self._key_in_slot(name, data)
        except _Damaged as exc:
            await self._remove_damaged(name, str(exc), etag)
            return _Unlisted.JUDGED
        self._damage_not_repeated("listing", name, first_damage)
        return key

    def _key_in_slot(self, name: str, data: bytes) -> ObjectKey | _Unlisted:
        """The key the header slot of the digest-named object ``name`` tells; JUDGED for a
        record kept (counted); :class:`_Damaged` for one to remove."""
        try:
            key = record_key(data)
        except RecordError as exc:
            if keeps_unlisted(self.name, name, exc, self.context.count):
                return _Unlisted.JUDGED
            raise _Damaged(str(exc)) from exc
        if self.names.of(key) != name:
            # An intact header naming a key whose object has another name: no writer puts
            # a record here, and a lookup of this name's key keeps it as another key's --
            # so nothing would ever remove it (as the file stores' listings rule).
            raise _Damaged(f"its header names {key.file_stem()}, whose object is {self.names.of(key)}")
        return key

    def _unreadable_listed(self, name: str, exc: Exception) -> _Unlisted:
        """A listed object whose header could not be read: not listed, kept."""
        if self.client.closing:
            # Refused by the close, not a read error: the listing ends failed, never
            # taken for the whole prefix with the rest of the page left out.
            raise exc
        if not is_missing_object(exc):  # else removed since the page was listed
            self.context.count("listing_read_errors")
            self.context.warn(
                "listing_read",
                "cannot read the header of listed %s: %s; not listed, kept (a read error is not damage)",
                name,
                describe(exc),
            )
        return _Unlisted.JUDGED

    # -- helpers ---------------------------------------------------------------------------

    async def _first_bytes(self, name: str, if_match: str | None = None) -> tuple[bytes, int, str | None]:
        """The header slot of an object, the object's whole size and its ETag (one ranged
        GET; only of the object read as ``if_match`` when given)."""
        condition = {"IfMatch": if_match} if if_match else {}
        answer = await self.client.request(
            "get_object", Key=name, Range=f"bytes=0-{HEADER_BYTES - 1}", **condition
        )
        body = answer["Body"]
        # A store that ignored the range sends the whole object: read the slot only.
        slot = min(HEADER_BYTES, int(answer["ContentLength"]))
        try:
            return await read_exactly(body, slot), total_size(answer), answer.get("ETag")
        finally:
            body.close()

    def _header(self, key: ObjectKey, data: bytes) -> RecordHeader | None:
        """The verified header of ``key``'s record; None for a miss that is kept (a record
        of another serde chain or of another key -- e.g. an fs adapter on s3:// in this
        folder, whose "<name>.bin" is this codec's name of the key with ".bin" added to
        its salt -- or of a format version this code does not read, e.g. written by a
        newer server sharing the bucket); :class:`_Damaged` for the rest."""
        try:
            return self.context.read_record_header(data, key)
        except RecordError as exc:
            if self._deletes.kept_record(key, exc):
                return None
            raise _Damaged(str(exc)) from exc

    async def _remove_damaged(
        self, name: str, why: str, etag: str | None, key: ObjectKey | None = None
    ) -> None:
        """Remove the damaged object read as ``etag`` -- only if it is still that one: a
        record another server stored there since is kept (a conditional delete; a store
        that ignores the condition removes whatever is there, as a plain delete).  Once
        removed, the bytes accounted for ``key`` (None: a listed object, not accounted) are
        released (``record_removed``).

        Read without an ETag, it is kept, counted (``corrupt_kept_without_etag``): an
        unconditional removal could take a record another server stored there since.
        Kept damage is never served (each lookup or load of it is a miss, counted again)
        and the next store of its key replaces it; S3 services name an ETag in every
        answer, so only a store that sends none keeps damage this way."""
        if not etag:
            self.context.count("corrupt_kept_without_etag")
            self.context.warn(
                "damaged_no_etag",
                "s3://%s/%s is damaged (%s); a miss, kept: it was read without an ETag, and an "
                "unconditional removal could take a record stored there since",
                self.config.bucket,
                name,
                why,
            )
            return
        # Read before the removal: a store of the key settling since keeps its own entry.
        accounted = self.context.accounted_size(key) if key is not None else None
        try:
            await self.client.call("delete_object", Key=name, IfMatch=etag)
        except Exception as exc:
            if is_missing_object(exc):
                self._damaged_removed(name, why)  # removed meanwhile (by another server)
                return
            # Counted by what became of it, never as removed: the object is still there.
            if error_code(exc) == "PreconditionFailed":
                self.context.count("corrupt_replaced_before_removal")
                self.context.warn(
                    "replaced",
                    "damaged %s (%s) was replaced before its removal; the new object is kept",
                    name,
                    why,
                )
                return
            self.context.count("corrupt_remove_failures")
            self.context.warn(
                "remove", "removing damaged %s (%s) failed: %s; a miss, kept", name, why, describe(exc)
            )
            return
        self._damaged_removed(name, why)
        if key is not None:
            self.context.record_removed(key, accounted)

    def _damaged_removed(self, name: str, why: str) -> None:
        self.context.count("corrupt_records_removed")
        self.context.warn(
            "damaged", "s3://%s/%s is damaged (%s); a miss, removed", self.config.bucket, name, why
        )

    async def _each(
        self, op: str, calls: Sequence[Awaitable[T]], *, whole: bool = False
    ) -> tuple[list[T | None], int]:
        """Await one coroutine per key: the results, a failed key's None (the caller's
        failure value), and how many failed (counted, logged); a batch whose every key
        failed (``whole``: any key) raises."""
        if not calls:
            return [], 0
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        failures = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
        for outcome in failures:
            if not isinstance(outcome, Exception):
                raise outcome
        missing_bucket = sum(1 for outcome in failures if is_missing_bucket(outcome))
        if missing_bucket:
            self._bucket_missing(missing_bucket)
        if failures and len(failures) == len(outcomes):
            raise S3RequestError(f"{op}: all {len(outcomes)} requests failed: {describe(failures[0])}")
        if failures:
            self._failed(op, len(failures), failures[0])
            if whole:
                raise S3RequestError(
                    f"{op}: {len(failures)} of {len(outcomes)} requests failed: {describe(failures[0])}"
                )
        return [None if isinstance(outcome, BaseException) else outcome for outcome in outcomes], len(
            failures
        )

    def _failed(self, op: str, count: int, example: BaseException) -> None:
        self.context.count(f"{op}_request_failures", count)
        self.context.warn(op, "%d %s requests failed, e.g. %s", count, op, describe(example))
