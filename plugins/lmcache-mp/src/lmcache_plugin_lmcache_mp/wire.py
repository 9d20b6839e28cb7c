"""LMCache's MP protocol on the wire: frames, operation ids, argument and reply encodings.

A request is ``[uid, op, arg_0, arg_1, ...]`` after the ROUTER's identity frame: ``uid``
is the client's msgpack request number (echoed back raw), ``op`` a msgpack int (a legacy
operation id) or str (an operation name), and each argument its own msgpack frame, in
signature order.  A reply is ``[uid, op]`` plus one msgpack frame when the result is not
None.  Arguments are decoded per operation with typed msgspec decoders, so a frame of the
wrong type fails in C before any handler runs.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

__all__ = [
    "OPERATION_IDS",
    "CacheKey",
    "RegisterPayload",
    "decode_arguments",
    "encode_reply",
    "operation_name",
]

#: LMCache's frozen table of legacy operation ids (id 11 is retired)
OPERATION_IDS: dict[str, int] = {
    "register_kv_cache": 1,
    "unregister_kv_cache": 2,
    "register_q_cache": 3,
    "unregister_q_cache": 4,
    "store_q": 5,
    "store": 6,
    "retrieve": 7,
    "lookup": 8,
    "query_prefetch_status": 9,
    "wait_prefetch_status": 10,
    "free_lookup_locks": 12,
    "end_session": 13,
    "register_kv_cache_engine_driven_context": 14,
    "unregister_kv_cache_engine_driven_context": 15,
    "prepare_store": 16,
    "commit_store": 17,
    "prepare_retrieve": 18,
    "commit_retrieve": 19,
    "clear": 20,
    "get_chunk_size": 21,
    "ping": 22,
    "report_block_allocation": 23,
    "noop": 24,
    "cb_register_rope": 25,
    "cb_unregister_rope": 26,
    "cb_retrieve_pre_computed": 27,
    "cb_unified_lookup": 28,
    "p2p_lookup_and_lock": 29,
    "p2p_query_lookup_results": 30,
    "p2p_unlock_objects": 31,
    "get_experimental": 32,
    "cb_protocol_handshake": 33,
}
_NAMES_BY_ID = {number: name for name, number in OPERATION_IDS.items()}
_MAX_OP_NAME = 64
#: the longest op frame worth decoding (a str of _MAX_OP_NAME bytes, or any int), and uid
#: frame worth decoding for a log line: a longer one is not decoded at all (a frame of a few
#: MiB of tiny msgpack maps or lists would become 50-70 times that in Python objects)
_MAX_OP_FRAME = _MAX_OP_NAME + 2
_MAX_UID_FRAME = 16
#: the largest argument frame decoded, but commit_store's pickled chunks (max_message_mb
#: bounds those): a key of up to 13 million tokens, each up to 5 bytes in msgpack.  The
#: frame limit is sized for the chunks, and a key that large would cost the server 8
#: times its size in Python objects, and its loop thread seconds of hashing per 100 MiB.
MAX_ARGUMENT_BYTES = 64 << 20
_BULK_ARGUMENTS = {("commit_store", 2)}

TokenId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]  # hashed as big-endian uint32
_NIL = msgspec.Raw(b"\xc0")


class CacheKey(msgspec.Struct, frozen=True, gc=False):
    """LMCache's ``IPCCacheServerKey``: a token range of one request, a map on the wire."""

    model_name: str
    world_size: int
    worker_id: int | None
    token_ids: list[TokenId]
    start: Annotated[int, msgspec.Meta(ge=0)]
    end: Annotated[int, msgspec.Meta(ge=0)]
    request_id: str
    cache_salt: str = ""
    #: never used here, so kept as its msgpack bytes: decoded, a map of a few MiB of tiny
    #: maps or lists would take 50-70 times its size in Python objects
    request_configs: msgspec.Raw = _NIL
    num_kv_readers: int = 0


class RegisterPayload(msgspec.Struct, frozen=True, gc=False):
    """``RegisterEngineDrivenContextPayload``: the KV layout of one worker instance."""

    instance_id: int
    model_name: str
    world_size: int
    block_size: int
    num_layers: int
    hidden_dim_size: int
    dtype_str: str
    use_mla: bool
    num_physical_slots: int | None = None


class RegisterReply(msgspec.Struct, gc=False):
    shm_name: str
    pool_size: int


class PrepareStoreReply(msgspec.Struct, gc=False):
    context: dict[str, Any]


class PrepareRetrieveReply(msgspec.Struct, gc=False):
    success: bool
    data: bytes
    context: dict[str, Any]


Seconds = float  # msgspec takes a msgpack int for a float too

#: argument types, in order, of every operation this front end decodes
SIGNATURES: dict[str, tuple[Any, ...]] = {
    "get_chunk_size": (),
    "noop": (),
    "get_experimental": (),
    "ping": (int | None,),
    "register_kv_cache_engine_driven_context": (RegisterPayload,),
    "unregister_kv_cache_engine_driven_context": (int,),
    "unregister_kv_cache": (int,),
    "lookup": (CacheKey, int),
    "free_lookup_locks": (CacheKey, int),
    "query_prefetch_status": (str,),
    "wait_prefetch_status": (str, Seconds),
    "end_session": (str,),
    "prepare_store": (CacheKey, int),
    "commit_store": (CacheKey, int, bytes),
    "prepare_retrieve": (CacheKey, int),
    "commit_retrieve": (CacheKey, int),
    "clear": (bool,),
    "report_block_allocation": (int, str, msgspec.Raw),  # records: answered, never read (see CacheKey)
}
_DECODERS: dict[str, tuple[msgspec.msgpack.Decoder[Any], ...]] = {
    name: tuple(msgspec.msgpack.Decoder(kind) for kind in kinds) for name, kinds in SIGNATURES.items()
}
_ANY = msgspec.msgpack.Decoder()
_ENCODER = msgspec.msgpack.Encoder()


def operation_name(frame: bytes) -> str:
    """The operation a request's op frame names; ValueError for anything else."""
    if len(frame) > _MAX_OP_FRAME:
        raise ValueError(f"op frame of {len(frame)} bytes names no operation")
    try:
        value = _ANY.decode(frame)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise ValueError(f"undecodable op frame {bytes(frame[:16]).hex()}") from exc
    if isinstance(value, bool):  # a msgpack bool is no operation id
        raise ValueError(f"op {value!r} is neither an operation id nor a name")
    if isinstance(value, int):
        name = _NAMES_BY_ID.get(value)
        if name is None:
            raise ValueError(f"unknown operation id {value}")
        return name
    if isinstance(value, str) and 0 < len(value) <= _MAX_OP_NAME:
        return value
    raise ValueError(f"op {str(value)[:40]!r} is neither an operation id nor a name")


def decode_arguments(name: str, frames: list[Any]) -> list[Any]:
    """The arguments of operation ``name`` (one of SIGNATURES); ValueError when their
    count or a type is wrong."""
    decoders = _DECODERS[name]
    if len(frames) != len(decoders):
        raise ValueError(f"{name} takes {len(decoders)} argument frames, got {len(frames)}")
    for index, frame in enumerate(frames):
        if len(frame) > MAX_ARGUMENT_BYTES and (name, index) not in _BULK_ARGUMENTS:
            raise ValueError(
                f"argument {index} of {name} is {len(frame)} bytes long; at most {MAX_ARGUMENT_BYTES}"
            )
    try:
        return [decoder.decode(frame) for decoder, frame in zip(decoders, frames, strict=True)]
    except (msgspec.DecodeError, RecursionError) as exc:  # ValidationError is a DecodeError
        raise ValueError(f"bad argument of {name}: {exc}") from exc


def encode_reply(value: Any) -> bytes:
    return _ENCODER.encode(value)


class EncodedReply:
    """A reply encoded already (off the loop thread), sent as ``payload`` as it is."""

    __slots__ = ("payload",)

    def __init__(self, payload: Any) -> None:
        self.payload = payload


def peek_uid(frame: bytes) -> str:
    """A request number for log lines, whatever the frame holds."""
    if len(frame) > _MAX_UID_FRAME:
        return f"0x{bytes(frame[:16]).hex()}..."
    try:
        value = _ANY.decode(frame)
    except (msgspec.DecodeError, RecursionError):
        return f"0x{bytes(frame[:16]).hex()}"
    return str(value)[:40]
