"""How records sit in the bucket: object names, the fixed header slot, bounded reads.

An object is ``<prefix>/<key_to_name(key)>`` and holds one record: the core record header
padded to :data:`HEADER_BYTES` (core's ``RECORD_ALIGN``, 4 KiB), then the payload.  The
fixed header size is what lets a bucket listing, which reports object sizes only, tell
each payload's size without reading a byte of it -- and so rebuild usage after a restart
at one request per 1000 objects.  Every header fits: a key is at most ~1.6 KiB, a layout
256 bytes.

Each object also carries a copy of its header in its user metadata (``x-amz-meta-`` +
:data:`HEADER_METADATA`: the header without its zero padding, in base64), written by the
same PUT as the record, so a lookup is one ``HEAD`` rather than a ranged ``GET`` (which
reads the object from its volume: on SeaweedFS a third dearer).  When the copy is missing
(a record written before copies existed, a store that drops metadata, a header too long
for S3's 2 KiB of metadata) or does not agree with the object, the lookup reads the
record's own header with a ranged ``GET``; only that header ever has an object removed
as damaged.

Reads never trust a length they have not checked: a header is read piece by piece as far
as its own length field says, and a payload is copied into the caller's buffer only once
the header's length equals the buffer's and the object's size equals header + payload.
"""

from __future__ import annotations

import base64
import binascii
import re
import zlib
from typing import Any

from lmcache_tiers.plugin import (
    HEADER_CRC_SIZE,
    RECORD_ALIGN,
    ObjectKey,
    is_digest_name,
    key_to_name,
    name_to_key,
)

#: every record header is padded to this size (core's, as the file stores pad theirs); a
#: listed object of N bytes holds a payload of N - HEADER_BYTES
HEADER_BYTES: int = RECORD_ALIGN
#: the largest object one PUT may create
MAX_PUT_BYTES = 5 << 30
#: the user-metadata name of an object's header copy (S3 lowercases metadata names)
HEADER_METADATA = "lmcache-tiers-header"
#: S3's limit on an object's user metadata: names and values, in bytes
_METADATA_LIMIT = 2048
_CONTENT_RANGE = re.compile(r"^bytes \d+-\d+/(\d+)$")


def crc32_checksum(body: bytes) -> str:
    """The ``x-amz-checksum-crc32`` of an upload: the store checks the body it received
    against it and refuses one damaged on the way (``BadDigest``) instead of storing it.
    CRC32 (zlib's, ~10x faster than MD5 here) rather than Content-MD5; the value is sent
    as a header, never as an aws-chunked trailer, which some S3-compatible services lack."""
    return base64.b64encode(zlib.crc32(body).to_bytes(4, "big")).decode("ascii")


class ShortBody(Exception):
    """The response body ended before the bytes its length announced."""


class ObjectNames:
    """Object names of keys under one prefix, and keys of listed names."""

    def __init__(self, prefix: str) -> None:
        #: what a listing asks for: the prefix as a folder ("" = the top level)
        self.folder = f"{prefix}/" if prefix else ""

    def of(self, key: ObjectKey) -> str:
        return self.folder + key_to_name(key)

    def key_of(self, object_name: str) -> ObjectKey | None:
        """The key a listed name encodes; None for digest names and foreign objects."""
        return name_to_key(object_name[len(self.folder) :])

    def is_digest(self, object_name: str) -> bool:
        return is_digest_name(object_name[len(self.folder) :])


def total_size(response: dict[str, Any]) -> int:
    """The whole object's size from a (ranged) GET response."""
    match = _CONTENT_RANGE.match(str(response.get("ContentRange") or ""))
    return int(match.group(1)) if match else int(response["ContentLength"])


async def read_exactly(body: Any, size: int) -> bytes:
    """The next ``size`` bytes of a streaming body; :class:`ShortBody` if it ends first."""
    parts: list[bytes] = []
    filled = 0
    while filled < size:
        chunk = await body.read(size - filled)
        if not chunk:
            raise ShortBody(f"the body ended after {filled} of {size} bytes")
        parts.append(chunk)
        filled += len(chunk)
    return b"".join(parts)


def header_metadata(header: bytes) -> dict[str, str]:
    """The user metadata that carries a copy of ``header`` (a whole :data:`HEADER_BYTES`
    slot); empty when the copy would pass S3's metadata limit (a key near its maximum)."""
    fields, crc = header[:-HEADER_CRC_SIZE], header[-HEADER_CRC_SIZE:]
    # Zeros stripped here are put back by header_from_metadata: the slot is zero-padded,
    # and a field that ends in zero bytes gets them back the same way.
    text = base64.b64encode(fields.rstrip(b"\0") + crc).decode("ascii")
    if len(HEADER_METADATA) + len(text) > _METADATA_LIMIT:
        return {}
    return {HEADER_METADATA: text}


def header_from_metadata(response: dict[str, Any]) -> bytes | None:
    """The header slot rebuilt from the copy in a HEAD response's metadata; None when the
    object has none.  Raises ValueError for a copy that cannot be one; whether a rebuilt
    slot is a header at all is for the record decoder (its crc) to say."""
    text = (response.get("Metadata") or {}).get(HEADER_METADATA)
    if text is None:
        return None
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"the header copy is not base64: {exc}") from exc
    if not HEADER_CRC_SIZE <= len(data) <= HEADER_BYTES:
        raise ValueError(f"the header copy is {len(data)} bytes")
    padding = bytes(HEADER_BYTES - len(data))
    return data[:-HEADER_CRC_SIZE] + padding + data[-HEADER_CRC_SIZE:]
