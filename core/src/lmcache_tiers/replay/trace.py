"""Mooncake-format request traces and the keys replay derives from them."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import msgspec

from lmcache_tiers.errors import TiersError
from lmcache_tiers.keys import ObjectKey

#: tokens per block in Mooncake traces (each hash id stands for 512 prompt tokens)
BLOCK_TOKENS = 512
#: model name and cache salt of replayed keys: never those of an engine's real data
REPLAY_MODEL = "lmcache-tiers-replay"
REPLAY_SALT = "replay"
#: the largest timestamp magnitude (ms) a trace may hold: past 2**53 a float no longer
#: tells whole milliseconds apart, and pacing's arithmetic on such values overflows
MAX_TIMESTAMP_MS = float(2**53)
#: the largest input_length or output_length accepted: a prompt length past 2**53 tokens is
#: no real request, and one such line would drown every token hit rate (and reach --json as
#: an integer its readers cannot hold)
MAX_LENGTH = 2**53
#: the longest trace line read (a request of a million tokens is some 20 KB): a file with no
#: line ends, such as /dev/zero, must end in an error, not in reading for ever
MAX_LINE_BYTES = 16 << 20
#: lines read between two calls of a progress hook: one a line would cost more than the parsing
PROGRESS_LINES = 4096


class TraceError(TiersError):
    """The trace file is missing or malformed; the message names the line."""


class _Line(msgspec.Struct):
    # Unknown fields are allowed: traces carry extras (e.g. a session id) replay ignores.
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]


_decoder = msgspec.json.Decoder(_Line)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: when it arrives and which prompt blocks it needs."""

    timestamp_ms: float
    input_length: int
    output_length: int
    #: block ids in prefix order, cut at the first repeat (a prefix never holds a block twice)
    hash_ids: tuple[int, ...]

    def prefix_tokens(self, blocks: int, block_tokens: int = BLOCK_TOKENS) -> int:
        """Prompt tokens covered by the first ``blocks`` blocks (the last one may be partial)."""
        return min(blocks * block_tokens, self.input_length)


@dataclass(frozen=True)
class Trace:
    """A whole trace in memory, in arrival order."""

    path: str
    requests: tuple[TraceRequest, ...]

    @property
    def block_references(self) -> int:
        return sum(len(request.hash_ids) for request in self.requests)

    @property
    def input_tokens(self) -> int:
        return sum(request.input_length for request in self.requests)

    def unique_blocks(self) -> int:
        return len({block for request in self.requests for block in request.hash_ids})

    def head(self, count: int | None) -> Trace:
        """The first ``count`` requests (all of them for None)."""
        if count is None or count >= len(self.requests):
            return self
        return Trace(self.path, self.requests[:count])

    def chain_conflicts(self) -> int:
        """Blocks seen after two different parents.

        In a well-formed trace a block id names a whole prefix, so each block has one
        parent (the block before it) and holding a block implies holding its ancestors
        whenever eviction goes tail first; Belady's optimum relies on it.
        """
        parent: dict[int, int] = {}
        # Blocks, not references: one sent again and again after a second parent is one.
        conflicted: set[int] = set()
        for request in self.requests:
            previous = -1
            for block in request.hash_ids:
                known = parent.setdefault(block, previous)
                if known != previous:
                    conflicted.add(block)
                previous = block
        return len(conflicted)


def _unique_prefix(hash_ids: list[int]) -> tuple[int, ...]:
    if len(set(hash_ids)) == len(hash_ids):
        return tuple(hash_ids)
    seen: set[int] = set()
    for position, block in enumerate(hash_ids):
        if block in seen:
            return tuple(hash_ids[:position])
        seen.add(block)
    return tuple(hash_ids)  # unreachable: a repeat was found above


def _parse_line(raw: bytes, where: str) -> TraceRequest:
    try:
        line = _decoder.decode(raw)
    except msgspec.ValidationError as exc:
        raise TraceError(f"{where}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise TraceError(f"{where}: not a JSON object ({exc})") from None
    except RecursionError:  # an (ignored) extra field nested past the decoder's stack
        raise TraceError(f"{where}: nested too deeply; not a request trace line") from None
    if line.input_length < 0 or line.output_length < 0:
        raise TraceError(f"{where}: input_length and output_length must not be negative")
    if line.input_length > MAX_LENGTH or line.output_length > MAX_LENGTH:
        raise TraceError(f"{where}: input_length and output_length must not exceed 2**53")
    # Negative and out-of-order timestamps are fine (pacing sends a request that is
    # already due at once); only magnitudes no clock can wait for are refused.
    if not -MAX_TIMESTAMP_MS <= line.timestamp <= MAX_TIMESTAMP_MS:
        raise TraceError(f"{where}: timestamp {line.timestamp:g} is outside -2**53..2**53 ms")
    for block in line.hash_ids:
        if not 0 <= block < 1 << 64:
            raise TraceError(f"{where}: hash id {block} is outside 0..2**64-1")
    # More ids than the prompt has blocks are blocks of another size (a trace hashed every
    # 16 tokens, say): replayed, each hit would count as 512 tokens, capped at the prompt,
    # and two hits out of 63 showed as a token hit rate of 100 %.  Fewer are fine: a trace
    # may hash only whole blocks, and the tokens past its ids are then never hit.
    blocks = -(-line.input_length // BLOCK_TOKENS)
    if len(line.hash_ids) > blocks:
        raise TraceError(
            f"{where}: {len(line.hash_ids)} hash ids for {line.input_length} input tokens, but a "
            f"Mooncake trace has one id per {BLOCK_TOKENS}-token block of the prompt (at most {blocks} here)"
        )
    return TraceRequest(line.timestamp, line.input_length, line.output_length, _unique_prefix(line.hash_ids))


def _read_line(handle: BinaryIO, name: str, number: int) -> bytes:
    try:
        return handle.readline(MAX_LINE_BYTES + 2)
    except OSError as exc:  # a failing disk or a file that cannot be read (EIO, EISDIR...)
        raise TraceError(f"{name} line {number}: cannot read: {exc.strerror or exc}") from None


def iter_trace(path: str | Path, progress: Callable[[int], None] | None = None) -> Iterator[TraceRequest]:
    """Requests of a trace file, one per non-empty line; TraceError names the bad line.
    ``progress(n)`` is told of the bytes read, every PROGRESS_LINES lines and at the end: a
    trace of gigabytes takes minutes to read."""
    name = str(path)
    try:
        handle = open(path, "rb")  # noqa: SIM115 -- closed by the with below; open errors differ
    except FileNotFoundError:
        raise TraceError(f"trace file {name} does not exist") from None
    except IsADirectoryError:
        raise TraceError(f"trace file {name} is a directory") from None
    except OSError as exc:
        raise TraceError(f"cannot read trace file {name}: {exc.strerror or exc}") from None
    with handle:
        number = unreported = 0
        # One byte past the limit and its line end: a line of exactly the limit is read whole.
        while raw := _read_line(handle, name, number + 1):
            number += 1
            unreported += len(raw)
            if progress is not None and number % PROGRESS_LINES == 0:
                progress(unreported)
                unreported = 0
            if len(raw.rstrip(b"\r\n")) > MAX_LINE_BYTES:
                raise TraceError(
                    f"{name} line {number}: longer than {MAX_LINE_BYTES >> 20} MiB; not a request trace"
                )
            if raw.strip():
                yield _parse_line(raw, f"{name} line {number}")
        if progress is not None and unreported:
            progress(unreported)


def read_trace(
    path: str | Path, limit: int | None = None, progress: Callable[[int], None] | None = None
) -> Trace:
    """The whole trace (or its first ``limit`` requests); an empty trace is an error.
    ``progress`` is told of the bytes read (see ``iter_trace``)."""
    requests: list[TraceRequest] = []
    if limit is None or limit > 0:
        for request in iter_trace(path, progress):
            requests.append(request)
            if limit is not None and len(requests) >= limit:
                break  # before the next line is read: what follows the head is not parsed
    if not requests:
        raise TraceError(f"trace file {path} holds no requests")
    return Trace(str(path), tuple(requests))


class KeySpace:
    """The ObjectKey of each block id: ``chunk_hash`` is the id as 8 big-endian bytes.

    Replay keys carry their own model name and salt, so they never collide with an
    engine's data on a shared server.  Keys are built once per block id and reused.
    """

    def __init__(self, model: str = REPLAY_MODEL, salt: str = REPLAY_SALT, kv_rank: int = 0) -> None:
        self.model = model
        self.salt = salt
        self.kv_rank = kv_rank
        self._keys: dict[int, ObjectKey] = {}
        # Validates the names once, with the user's spelling in the message.
        ObjectKey(model, kv_rank, bytes(8), 0, salt)

    def key(self, block: int) -> ObjectKey:
        found = self._keys.get(block)
        if found is None:
            found = self._keys[block] = ObjectKey(
                self.model, self.kv_rank, block.to_bytes(8, "big"), 0, self.salt
            )
        return found

    def keys(self, blocks: Sequence[int]) -> list[ObjectKey]:
        return [self.key(block) for block in blocks]

    @staticmethod
    def block_of(key: ObjectKey) -> int:
        return int.from_bytes(key.chunk_hash, "big")
