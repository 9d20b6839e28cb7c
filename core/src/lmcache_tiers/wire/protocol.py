"""The native wire protocol: msgspec Structs encoded as msgpack, carried over ZeroMQ.

A request is one ZeroMQ multipart message from a DEALER::

    [header, payload_0, payload_1, ...]

``header`` is one msgpack-encoded :data:`Request` (a tagged array: ``[op, req_id, token,
...fields]``); payload frames follow only for :class:`StoreInline` (one per key, in key
order).  The server's ROUTER prepends the peer identity, and replies the same way: one
:data:`Reply` header (``[op, req_id, code, message, ...fields]``), then payload frames only
for an inline :class:`RetrieveReply`.  Keeping payloads in their own frames means neither
side copies KV bytes through msgpack, and a local client moves no payload bytes over the
socket at all: it copies into and out of the L1 shared-memory segment at the offsets a
reply names.

Additions keep version 1 compatible: a new request gets a new op number (an older server
answers UNKNOWN_OP), a new field goes at the end of its Struct with a default (msgspec
ignores trailing fields it does not know, in both directions), and a client that needs a
server-side behaviour checks :data:`FEATURES` in the HELLO reply first, since an older
server would ignore the field silently.

Every reply carries an :class:`ErrorCode` and a message; a request the server cannot
decode gets an :class:`ErrorReply` (or is dropped with a log line when it cannot be
answered).  No request field is a file path: keys are validated ObjectKeys, and the only
name the server hands out is that of its own shared-memory segment.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Union

import msgspec

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.layout import MAX_LAYOUT_LEN

#: Bumped on any incompatible change; checked in the HELLO handshake.
PROTOCOL_VERSION = 1

DEFAULT_URL = "tcp://127.0.0.1:5555"

#: What this server does beyond the first version-1 servers, announced in HELLO:
#: ``l1_only_store`` -- STORE_COMMIT/STORE_INLINE honour ``l1_only``;
#: ``evict`` -- the EVICT request exists;
#: ``lookup_wait`` -- LOOKUP honours ``wait_s``;
#: ``release_once`` -- RELEASE honours ``once``;
#: ``retrieve_layouts`` -- RETRIEVE honours ``layouts``.
FEATURES = ("l1_only_store", "evict", "lookup_wait", "release_once", "retrieve_layouts")

#: Keys one request may name; clients split larger batches.
MAX_KEYS_PER_REQUEST = 8192
#: Size limit of the msgpack header frame (8192 keys of ~100 bytes fit easily).
MAX_HEADER_BYTES = 4 << 20
#: Upper bound on one object; the arena's own size is the tighter limit in practice.
MAX_OBJECT_BYTES = 1 << 40
#: Longest auth token (and client name) a request may carry.
MAX_TOKEN_LEN = 256
#: Longest wait a request may ask for (WAIT_PREFETCH_STATUS, LOOKUP's ``wait_s``).
MAX_WAIT_S = 3600.0


class Op(enum.IntEnum):
    """Request kinds; the reply to a request carries the same tag (errors carry ERROR)."""

    ERROR = 0
    HELLO = 1
    PING = 2
    LOOKUP = 3
    QUERY_PREFETCH_STATUS = 4
    WAIT_PREFETCH_STATUS = 5
    STORE_RESERVE = 6
    STORE_COMMIT = 7
    STORE_ABORT = 8
    STORE_INLINE = 9
    RETRIEVE = 10
    RELEASE = 11
    CLEAR = 12
    STATUS = 13
    EVICT = 14


class ErrorCode(enum.IntEnum):
    OK = 0
    MALFORMED = 1  # not a decodable request of a known shape
    UNKNOWN_OP = 2  # a well-formed array whose op tag this server does not know
    VERSION_MISMATCH = 3
    UNAUTHORIZED = 4  # missing or wrong auth token
    TOO_LARGE = 5  # header, key or frame count, or inline payload over the server's limits
    INVALID_ARGUMENT = 6  # decodable but inconsistent (e.g. payload count != key count)
    NOT_FOUND = 7  # e.g. a prefetch handle this client does not own
    OUT_OF_MEMORY = 8  # L1 cannot hold the batch right now
    SHUTTING_DOWN = 9
    INTERNAL = 10  # a bug or a failing component; the message says which


_U63 = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
_Keys = Annotated[list[ObjectKey], msgspec.Meta(max_length=MAX_KEYS_PER_REQUEST)]
_Size = Annotated[int, msgspec.Meta(ge=1, le=MAX_OBJECT_BYTES)]
_Sizes = Annotated[list[_Size], msgspec.Meta(max_length=MAX_KEYS_PER_REQUEST)]
_Timeout = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_WAIT_S)]
_Text = Annotated[str, msgspec.Meta(max_length=MAX_TOKEN_LEN)]
#: per-key tensor layouts ("" = unknown); an empty list means none were given
_Layouts = Annotated[
    list[Annotated[str, msgspec.Meta(max_length=MAX_LAYOUT_LEN)]],
    msgspec.Meta(max_length=MAX_KEYS_PER_REQUEST),
]


# -- requests ------------------------------------------------------------------------------


class _Request(msgspec.Struct, array_like=True, gc=False, tag_field="op"):
    """Fields every request starts with; ``token`` is "" when the server needs none."""

    req_id: _U63
    token: _Text


class Hello(_Request, tag=Op.HELLO.value):
    """Handshake: protocol version check and the data-plane parameters in the reply."""

    version: int
    client_name: _Text = ""
    pid: int = 0


class Ping(_Request, tag=Op.PING.value):
    pass


class Lookup(_Request, tag=Op.LOOKUP.value):
    """Start an L1+L2 prefix lookup with prefetch; the hit prefix is read-locked for the
    client until RETRIEVE/RELEASE (or the lock TTL).

    ``wait_s``: when the prefetch has to go to L2, wait up to that long for it before
    answering, as a WAIT_PREFETCH_STATUS would (feature ``lookup_wait``; 0: answer at once
    with the handle).  Whatever the reply, the hit count is in it once known; a handle
    whose count is not is asked about as usual.
    """

    keys: _Keys
    wait_s: _Timeout = 0.0


class QueryPrefetchStatus(_Request, tag=Op.QUERY_PREFETCH_STATUS.value):
    handle: _U63


class WaitPrefetchStatus(_Request, tag=Op.WAIT_PREFETCH_STATUS.value):
    handle: _U63
    timeout_s: _Timeout


class StoreReserve(_Request, tag=Op.STORE_RESERVE.value):
    """Reserve arena extents for the keys not yet in L1 (all or nothing).

    ``layouts``: optional tensor layout per key (``"bfloat16[2,16,256,1024]"``, "" when
    unknown), checked against the size and kept for the L2 serde chains.
    """

    keys: _Keys
    sizes: _Sizes
    layouts: _Layouts = []


class StoreCommit(_Request, tag=Op.STORE_COMMIT.value):
    """Make reserved keys READY.  ``l1_only``: never copy them to L2 (a benchmark's or a
    scratch object); they stay L1-only even if stored again later under the same key."""

    keys: _Keys
    l1_only: bool = False


class StoreAbort(_Request, tag=Op.STORE_ABORT.value):
    keys: _Keys


class StoreInline(_Request, tag=Op.STORE_INLINE.value):
    """Store with the bytes in the message: one payload frame per key follows.
    ``layouts`` as for STORE_RESERVE, ``l1_only`` as for STORE_COMMIT."""

    keys: _Keys
    layouts: _Layouts = []
    l1_only: bool = False


class Retrieve(_Request, tag=Op.RETRIEVE.value):
    """Read-lock the READY prefix of ``keys``.

    With ``inline`` the bytes come back as payload frames and every lock this client holds
    on the returned keys is dropped before the reply; otherwise the reply names arena slots
    and the keys stay locked until RELEASE.

    ``layouts`` (feature ``retrieve_layouts``): the layout the reader will read each
    object as ("" for any, as plain bytes); the hit prefix ends at the first object of
    another layout, or of unknown layout and another size -- a key names no dtype, so
    another engine's chunk of the same tokens would otherwise be read as other numbers.
    """

    keys: _Keys
    inline: bool = False
    layouts: _Layouts = []


class Release(_Request, tag=Op.RELEASE.value):
    """Drop every read lock this client holds on ``keys`` (from LOOKUP or RETRIEVE).

    ``once``: drop one lock per key instead (feature ``release_once``) -- what one request
    took, e.g. a LOOKUP whose reply came after its caller gave up, while the client may
    hold other locks on the same keys (a RETRIEVE whose slots it is reading).
    """

    keys: _Keys
    once: bool = False


class Clear(_Request, tag=Op.CLEAR.value):
    force: bool = False


class Status(_Request, tag=Op.STATUS.value):
    pass


class Evict(_Request, tag=Op.EVICT.value):
    """Delete ``keys`` from L1 now; keys locked by any client (or by an L2 store in
    progress) are skipped.  L2 copies are not touched, so this removes an object from the
    server only when it never went to L2 (``l1_only``)."""

    keys: _Keys


Request = Union[
    Hello,
    Ping,
    Lookup,
    QueryPrefetchStatus,
    WaitPrefetchStatus,
    StoreReserve,
    StoreCommit,
    StoreAbort,
    StoreInline,
    Retrieve,
    Release,
    Clear,
    Status,
    Evict,
]


# -- replies -------------------------------------------------------------------------------


class Slot(msgspec.Struct, array_like=True, gc=False):
    """Where an object's bytes are in the arena; ``offset`` is -1 when there is no slot
    (a key already stored, or an inline reply whose bytes are in a payload frame).

    ``generation``: the extent's entry in the segment's generation table when the slot
    was handed out.  While the table still shows it, the extent has not changed hands;
    a client compares after copying (0 from a server without a table, which is never
    checked).
    """

    offset: int
    size: int
    generation: int = 0


NO_SLOT = -1


class _Reply(msgspec.Struct, array_like=True, gc=False, tag_field="op"):
    req_id: int
    code: int = ErrorCode.OK.value
    message: str = ""


class ErrorReply(_Reply, tag=Op.ERROR.value):
    pass


class HelloReply(_Reply, tag=Op.HELLO.value):
    version: int = PROTOCOL_VERSION
    server_version: str = ""
    chunk_size: int = 0
    #: "" when the server offers no shared-memory data plane (--no-shm)
    shm_name: str = ""
    shm_size: int = 0
    #: identity of the segment file, so a client on another host (or in another /dev/shm
    #: namespace) that happens to find a segment of the same name does not use it
    shm_device: int = 0
    shm_inode: int = 0
    lock_ttl_s: float = 0.0
    max_keys: int = MAX_KEYS_PER_REQUEST
    max_inline_bytes: int = 0
    #: byte offset of the generation table in the segment (0: none; see Slot.generation)
    generation_offset: int = 0
    #: arena bytes per table entry: an extent at ``offset`` is entry ``offset // block``
    generation_block: int = 0
    #: :data:`FEATURES` of this server; empty from servers older than the list
    features: list[str] = []
    #: the directory holding the segment file; "" means /dev/shm (and is what servers
    #: older than the field send, while clients older than it only look in /dev/shm)
    shm_dir: str = ""


class PingReply(_Reply, tag=Op.PING.value):
    pass


class LookupReply(_Reply, tag=Op.LOOKUP.value):
    handle: int = 0
    #: prefix hits in L1+L2 when the lookup finished at once, else None (ask with the handle)
    hits: int | None = None


class PrefetchStatusReply(_Reply, tag=Op.QUERY_PREFETCH_STATUS.value):
    """Reply to QUERY_ and WAIT_PREFETCH_STATUS: ``hits`` is None while still running."""

    hits: int | None = None


class StoreReserveReply(_Reply, tag=Op.STORE_RESERVE.value):
    slots: list[Slot] = []


class StoreReply(_Reply, tag=Op.STORE_COMMIT.value):
    """Reply to STORE_COMMIT, STORE_ABORT and STORE_INLINE: one flag per requested key
    (committed / aborted / newly stored)."""

    done: list[bool] = []


class RetrieveReply(_Reply, tag=Op.RETRIEVE.value):
    """One slot per key of the hit prefix; inline replies have one payload frame per slot.
    ``truncated``: an inline reply stopped early at the size limit; ask again for the rest."""

    slots: list[Slot] = []
    truncated: bool = False


class ReleaseReply(_Reply, tag=Op.RELEASE.value):
    released: int = 0


class ClearReply(_Reply, tag=Op.CLEAR.value):
    cleared: int = 0


class StatusReply(_Reply, tag=Op.STATUS.value):
    status: dict[str, Any] = {}


class EvictReply(_Reply, tag=Op.EVICT.value):
    evicted: int = 0


Reply = Union[
    ErrorReply,
    HelloReply,
    PingReply,
    LookupReply,
    PrefetchStatusReply,
    StoreReserveReply,
    StoreReply,
    RetrieveReply,
    ReleaseReply,
    ClearReply,
    StatusReply,
    EvictReply,
]

# One encoder and one decoder per direction, shared by every message: building them costs
# far more than using them.
encoder = msgspec.msgpack.Encoder()
request_decoder: msgspec.msgpack.Decoder[Request] = msgspec.msgpack.Decoder(Request)
reply_decoder: msgspec.msgpack.Decoder[Reply] = msgspec.msgpack.Decoder(Reply)
_untyped_decoder = msgspec.msgpack.Decoder()

_KNOWN_OPS = frozenset(op.value for op in Op if op is not Op.ERROR)


def encode(message: msgspec.Struct) -> bytes:
    return encoder.encode(message)


def peek_request_id(header: bytes) -> int:
    """The request id of a header too large to decode, read from its first bytes (0 when
    they are not the start of a request): a refusal that names it reaches its caller at
    once instead of leaving it waiting for a reply that never comes."""
    view = memoryview(header)[:32]
    try:
        lead = view[0]
        if 0x90 <= lead <= 0x9F:  # fixarray
            position = 1
        elif lead == 0xDC:  # array 16
            position = 3
        elif lead == 0xDD:  # array 32
            position = 5
        else:
            return 0
        if view[position] > 0x7F:  # the op tag is a positive fixint
            return 0
        position += 1
        kind = view[position]
        if kind <= 0x7F:
            return int(kind)
        widths = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}
        width = widths.get(kind)
        if width is None:
            return 0
        raw = view[position + 1 : position + 1 + width]
        if len(raw) < width:
            return 0
        value = int.from_bytes(raw, "big")
        return value if value < 1 << 63 else 0
    except IndexError:
        return 0


def diagnose_undecodable(header: bytes) -> tuple[int, ErrorCode]:
    """For a header that failed typed decoding: the request id to answer (0 if unknown)
    and whether the op is unknown, a list in it is over :data:`MAX_KEYS_PER_REQUEST`, or
    the message is merely malformed.

    Only the request's first two fields are decoded: the next four (where every request
    has its lists) are spans of the header and the rest are skipped unread, so a 4 MiB
    header of a hundred thousand keys, or of a million fields, costs the loop thread a
    scan, not the objects an untyped decoding would build for each."""
    try:
        head = _head_decoder.decode(header)
    except (msgspec.DecodeError, ValueError, RecursionError):
        return 0, ErrorCode.MALFORMED  # not an array, or of fewer than two fields
    op, req_id = _small_scalar(head.op), _small_scalar(head.req_id)
    valid_id = isinstance(req_id, int) and not isinstance(req_id, bool) and 0 <= req_id < 1 << 63
    answer_id = req_id if valid_id else 0
    if isinstance(op, int) and not isinstance(op, bool) and op not in _KNOWN_OPS:
        return answer_id, ErrorCode.UNKNOWN_OP
    lists = (head.field_2, head.field_3, head.field_4, head.field_5)
    if any(_array_length(field) > MAX_KEYS_PER_REQUEST for field in lists):
        return answer_id, ErrorCode.TOO_LARGE
    return answer_id, ErrorCode.MALFORMED


class _Head(msgspec.Struct, array_like=True, gc=False):
    """A request's first fields, each left encoded: the op tag, the request id, and the
    four after them, which hold every request's key, size and layout lists.  Fields past
    those are skipped without being built (an array-like struct ignores trailing items)."""

    op: msgspec.Raw
    req_id: msgspec.Raw
    field_2: msgspec.Raw = msgspec.Raw(b"")
    field_3: msgspec.Raw = msgspec.Raw(b"")
    field_4: msgspec.Raw = msgspec.Raw(b"")
    field_5: msgspec.Raw = msgspec.Raw(b"")


_head_decoder: msgspec.msgpack.Decoder[_Head] = msgspec.msgpack.Decoder(_Head)
#: longest encoding of an op tag or a request id (a 64-bit integer)
_SCALAR_BYTES = 9


def _small_scalar(field: msgspec.Raw) -> Any:
    """The value of an encoded field short enough to be an integer (None otherwise, or
    when it does not decode: a short ext of type -1 is a malformed timestamp, and the
    diagnosis must answer MALFORMED, not raise on the loop thread)."""
    if len(field) > _SCALAR_BYTES:
        return None
    try:
        return _untyped_decoder.decode(field)
    except (msgspec.DecodeError, ValueError):
        return None


def _array_length(field: msgspec.Raw) -> int:
    """How many items an encoded msgpack array holds, read from its first bytes (0 for
    anything else)."""
    view = memoryview(field)
    lead = view[0] if len(view) else 0
    if 0x90 <= lead <= 0x9F:  # fixarray
        return lead & 0x0F
    width = {0xDC: 2, 0xDD: 4}.get(lead)  # array 16, array 32
    if width is None or len(view) < 1 + width:
        return 0
    return int.from_bytes(view[1 : 1 + width], "big")
