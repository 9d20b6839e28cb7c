"""The ``aesgcm`` serde: AES-256-GCM frames bound to the object key.

Frame layout (version 3; version 2 is the same bytes)::

    magic "LTAG" | version u8 | flags u8 | layout length u16 | key check 8B | epoch 16B
    | nonce 12B | layout (ASCII) | ciphertext | tag 16B

Version 2 frames (the chain not bound) and version 1 frames (no layout either; the u16
was reserved, 0) are still read unless ``read_unbound_frames`` is false, version 1 only
where its record states no layout.  A version after 3 is a newer release's frame or a
damaged one (``newer_frames``), unless the frame authenticates with one of this release's
versions put back in its version byte: then it is proven damaged (``corrupt_frames``).

Keys.  Nothing is encrypted under the configured master key itself.  Each frame is
encrypted under ``HKDF-SHA256(master, salt=epoch, info=label [+ cache_salt])``: ``epoch``
is 16 random bytes a serde instance picks at start and again after every
``EPOCH_OBJECTS`` encryptions, which keeps the number of random 96-bit nonces drawn under
one key far below the 2^32 that NIST SP 800-38D allows, however long a server runs;
``cache_salt`` (flag bit 0) gives every tenant its own key.  ``key check`` is 8 bytes
derived from the master key alone, so a frame written under another master key is
reported as such instead of as tampering; it also picks, among the configured key and the
retired keys kept for reading after a rotation (``read_key_files``/``read_key_envs``),
the one a frame was written under.  New frames always use the configured key.

Associated data: the 44 header bytes, the layout, the plaintext length (u64), the full
object key (``ObjectKey.to_bytes()``) and, from version 3, the serde chain and this
stage's position in it (``SerdeContext.chain``/``position``).  A frame moved under another
key, a changed flag or epoch, a truncated or extended frame and any flipped bit all fail
authentication: decode raises, and the adapter counts the object as a miss.

The chain: core's record header names it outside any serde, and core checks only that it
is the adapter's own.  Two adapters sharing a master key with different chains (``[zstd,
aesgcm]`` and ``[aesgcm]``) would otherwise let someone who can write the store rename a
record's chain and L1 size so that the decrypted zstd frame is handed out as the object.

The layout is the one the object's record states (``SerdeContext.record_layout``): a loaded
object gets it in L1, and a later fp8 stage quantizes by it.  Core's record header carries
it outside any serde, so the frame carries its own authenticated copy, and decode refuses a
frame whose record states another layout (``layout_mismatch``): someone who can write the
store and recompute the record checksum cannot make an object's bytes read as another dtype.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from collections import Counter, OrderedDict
from typing import Final, NoReturn

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from lmcache_plugin_serde_aesgcm import AesGcmConfig
from lmcache_plugin_serde_aesgcm.keys import KEY_SIZE, read_key_env, read_key_file
from lmcache_tiers.plugin import MAX_LAYOUT_LEN, SerdeContext

log = logging.getLogger("lmcache_tiers.serde.aesgcm")

MAGIC: Final = b"LTAG"
VERSION: Final = 3
#: the frame version binding the layout but not the chain, still read (unless configured)
VERSION_NO_CHAIN: Final = 2
#: the frame version without a layout, still read (unless configured)
VERSION_NO_LAYOUT: Final = 1
_UNBOUND_VERSIONS: Final = (VERSION_NO_CHAIN, VERSION_NO_LAYOUT)
FLAG_PER_SALT: Final = 0x01
NONCE_SIZE: Final = 12
TAG_SIZE: Final = 16
EPOCH_SIZE: Final = 16
KEY_CHECK_SIZE: Final = 8
_HEADER = struct.Struct(f"<4sBBH{KEY_CHECK_SIZE}s{EPOCH_SIZE}s{NONCE_SIZE}s")
HEADER_SIZE: Final = _HEADER.size
#: encryptions under one derived key before the instance moves to a fresh epoch
EPOCH_OBJECTS: Final = 1 << 28
_DATA_LABEL: Final = b"lmcache-tiers aesgcm v1 data key"
_CHECK_LABEL: Final = b"lmcache-tiers aesgcm v1 key check"
#: derived keys kept per (epoch, salt); older epochs are re-derived on demand
_KEY_CACHE_SIZE: Final = 1024

#: what ``stats()`` reports
COUNTERS: Final = (
    "encrypted_objects",
    "decrypted_objects",
    "auth_failures",
    "wrong_key",
    "corrupt_frames",
    "layout_mismatch",
    "layoutless_frames_refused",
    "newer_frames",
    "unbound_frames_read",
    "unbound_frames_refused",
    "retired_key_frames_read",
    "key_epochs",
)


class AesGcmDecodeError(ValueError):
    """A frame that does not decrypt: damaged, tampered, moved, or under another key."""


def _hkdf(master: bytes, length: int, salt: bytes | None, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=salt, info=info).derive(master)


def _key_check(master: bytes) -> bytes:
    return _hkdf(master, KEY_CHECK_SIZE, None, _CHECK_LABEL)


def _retired_keys(config: AesGcmConfig) -> list[bytes]:
    """The retired keys kept for reading, each read and checked as the configured key is."""
    return [read_key_file(path, "read_key_files") for path in config.read_key_files] + [
        read_key_env(name, "read_key_envs") for name in config.read_key_envs
    ]


def _associated_data(
    header: bytes | memoryview, layout: bytes | memoryview, length: int, context: SerdeContext, version: int
) -> bytes:
    parts = [header, layout, length.to_bytes(8, "little"), context.key.to_bytes()]
    if version == VERSION:
        parts.append(_chain_binding(context))
    return b"".join(parts)


def _chain_binding(context: SerdeContext) -> bytes:
    """The chain's names and this stage's position, each name length-prefixed, so that no
    two different chains (or positions) give the same bytes."""
    names = [name.encode("utf-8") for name in context.chain]
    counts = struct.pack("<HH", context.position, len(names))
    return counts + b"".join(struct.pack("<H", len(name)) + name for name in names)


def _auth_failure_reason(version: int) -> str:
    """Why a frame failed authentication; from version 3 a record naming another serde
    chain (or this stage at another position) is one more cause the operator must see."""
    causes = "the frame was altered, truncated or stored under another key"
    if version == VERSION:
        causes = "the frame was altered, truncated, stored under another key or bound to another serde chain"
    return f"authentication failed: {causes}"


class AesGcmSerde:
    """AES-256-GCM per object; see the module docstring for keys and the frame."""

    name = "aesgcm"

    def __init__(self, config: AesGcmConfig) -> None:
        self.config = config
        if config.key_file is not None:
            master = read_key_file(config.key_file)
        else:
            assert config.key_env is not None  # the config's __post_init__ requires one
            master = read_key_env(config.key_env)
        assert len(master) == KEY_SIZE
        self._key_check = _key_check(master)
        # Every key a frame may be under, by key check: the configured one, then the
        # retired ones (a retired key equal to the configured one changes nothing).
        self.__masters = {_key_check(key): key for key in _retired_keys(config)}
        self.__masters[self._key_check] = master
        self._lock = threading.Lock()
        self._ciphers: OrderedDict[tuple[bytes, bytes, str | None], AESGCM] = OrderedDict()
        self._counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self._epoch = b""
        self._epoch_left = 0

    @staticmethod
    def preflight(config: AesGcmConfig) -> None:
        """Read every key the config names, as the serde does, before the server pre-faults
        L1: a key file missing or holding no key is refused without that wait."""
        if config.key_file is not None:
            read_key_file(config.key_file)
        else:
            assert config.key_env is not None  # the config's __post_init__ requires one
            read_key_env(config.key_env)
        _retired_keys(config)

    def __repr__(self) -> str:
        source = (
            f"key_file={self.config.key_file!r}"
            if self.config.key_file
            else f"key_env={self.config.key_env!r}"
        )
        retired = len(self.__masters) - 1
        return f"AesGcmSerde({source}, retired_keys={retired}, per_salt_keys={self.config.per_salt_keys})"

    # -- Serde ------------------------------------------------------------------------------

    def max_encoded_size(self, size: int) -> int:
        return HEADER_SIZE + MAX_LAYOUT_LEN + size + TAG_SIZE

    def encode(self, data: memoryview, context: SerdeContext) -> memoryview:
        view = memoryview(data).cast("B")
        flags = FLAG_PER_SALT if self.config.per_salt_keys else 0
        epoch = self._current_epoch()
        layout = context.record_layout.encode("ascii")
        if len(layout) > MAX_LAYOUT_LEN:
            raise ValueError(f"layout is {len(layout)} bytes long; at most {MAX_LAYOUT_LEN}")
        nonce = os.urandom(NONCE_SIZE)
        header = _HEADER.pack(MAGIC, VERSION, flags, len(layout), self._key_check, epoch, nonce)
        cipher = self._cipher(
            self._key_check, epoch, context.key.cache_salt if flags & FLAG_PER_SALT else None
        )
        start = HEADER_SIZE + len(layout)
        frame = bytearray(start + view.nbytes + TAG_SIZE)
        frame[:HEADER_SIZE] = header
        frame[HEADER_SIZE:start] = layout
        associated = _associated_data(header, layout, view.nbytes, context, VERSION)
        cipher.encrypt_into(nonce, view, associated, memoryview(frame)[start:])
        self._count("encrypted_objects")
        return memoryview(frame)

    def decode(self, data: memoryview, context: SerdeContext) -> memoryview:
        view = memoryview(data).cast("B")
        if view.nbytes < HEADER_SIZE + TAG_SIZE:
            self._refuse("corrupt_frames", context, f"{view.nbytes} bytes is shorter than an aesgcm frame")
        magic, version, flags, layout_length, key_check, epoch, nonce = _HEADER.unpack_from(view)
        if magic == MAGIC and version > VERSION:
            self._refuse_unknown_version(view, context, version)
        if magic != MAGIC or version not in (VERSION, *_UNBOUND_VERSIONS):
            self._refuse(
                "corrupt_frames",
                context,
                f"not an aesgcm frame (magic {bytes(magic)!r}, version {version})",
            )
        if flags & ~FLAG_PER_SALT or (version == VERSION_NO_LAYOUT and layout_length):
            self._refuse("corrupt_frames", context, f"unknown flags {flags:#x}/{layout_length:#x}")
        start = HEADER_SIZE + layout_length
        if layout_length > MAX_LAYOUT_LEN or view.nbytes < start + TAG_SIZE:
            self._refuse(
                "corrupt_frames", context, f"a layout of {layout_length} bytes in a {view.nbytes}-byte frame"
            )
        if key_check not in self.__masters:
            self._refuse(
                "wrong_key",
                context,
                "encrypted under another master key (its key check is not the key's nor a retired key's)",
            )
        if version in _UNBOUND_VERSIONS and not self.config.read_unbound_frames:
            self._refuse(
                "unbound_frames_refused",
                context,
                f"a version {version} frame does not bind the serde chain (read_unbound_frames is false)",
            )
        layout = view[HEADER_SIZE:start]
        if version == VERSION_NO_LAYOUT and context.record_layout:
            # Not tampering: the first releases wrote such records, and an operator must be
            # told that these misses go once the engine stores the objects again.
            self._refuse(
                "layoutless_frames_refused",
                context,
                f"a version 1 frame, written by an older release before frames bound the layout, "
                f"cannot vouch for the layout {context.record_layout!r} its record states; "
                f"a miss until stored again",
            )
        if context.record_layout and layout != context.record_layout.encode("ascii", "replace"):
            self._refuse(
                "layout_mismatch",
                context,
                f"the record states layout {context.record_layout!r}, the frame was written with "
                f"{bytes(layout).decode('ascii', 'replace')!r}",
            )
        length = view.nbytes - start - TAG_SIZE
        cipher = self._cipher(key_check, epoch, context.key.cache_salt if flags & FLAG_PER_SALT else None)
        plaintext = bytearray(length)
        try:
            cipher.decrypt_into(
                nonce,
                view[start:],
                _associated_data(view[:HEADER_SIZE], layout, length, context, version),
                memoryview(plaintext),
            )
        except InvalidTag:
            self._refuse("auth_failures", context, _auth_failure_reason(version))
        self._count("decrypted_objects")
        if key_check != self._key_check:
            # Stored again (by the engine, once it recomputes) only under the current key.
            self._count("retired_key_frames_read")
        if version in _UNBOUND_VERSIONS:
            # Read as before version 3: its record's chain could have been rewritten around it.
            self._count("unbound_frames_read")
        return memoryview(plaintext)

    def _refuse_unknown_version(self, view: memoryview, context: SerdeContext, version: int) -> NoReturn:
        """A version after this release's: a newer release's frame, or one of this release's
        whose version byte was damaged.  The version byte is authenticated, so a frame that
        authenticates with a version this release writes in its place is proven damaged
        (``corrupt_frames``); any other cannot be told from a newer format, whose header and
        associated data this release does not know, and is said to be either."""
        original = self._version_it_authenticates_as(view, context)
        if original is not None:
            self._refuse(
                "corrupt_frames",
                context,
                f"a version {original} frame whose version byte is damaged (it reads {version}): "
                f"it authenticates only with {original} in its place",
            )
        self._refuse(
            "newer_frames",
            context,
            f"a version {version} frame, written by a newer release or damaged (this one reads "
            f"versions 1 to {VERSION}, and the frame does not authenticate as one of them); a "
            f"miss here until stored again, kept for the servers that read it",
        )

    def _version_it_authenticates_as(self, view: memoryview, context: SerdeContext) -> int | None:
        """The version of this release's formats under which the frame, its version byte put
        back to it, authenticates; None when none does or the rest of its header is not one
        of this release's (unknown flags, layout length or key)."""
        _, _, flags, layout_length, key_check, epoch, nonce = _HEADER.unpack_from(view)
        start = HEADER_SIZE + layout_length
        if (
            flags & ~FLAG_PER_SALT
            or layout_length > MAX_LAYOUT_LEN
            or view.nbytes < start + TAG_SIZE
            or key_check not in self.__masters
        ):
            return None
        cipher = self._cipher(key_check, epoch, context.key.cache_salt if flags & FLAG_PER_SALT else None)
        header = bytearray(view[:HEADER_SIZE])
        layout = view[HEADER_SIZE:start]
        length = view.nbytes - start - TAG_SIZE
        scratch = bytearray(length)
        for candidate in (VERSION, *_UNBOUND_VERSIONS):
            if candidate == VERSION_NO_LAYOUT and layout_length:
                continue
            header[len(MAGIC)] = candidate  # the version byte follows the magic
            try:
                cipher.decrypt_into(
                    nonce,
                    view[start:],
                    _associated_data(bytes(header), layout, length, context, candidate),
                    memoryview(scratch),
                )
            except InvalidTag:
                continue
            return candidate
        return None

    def stats(self) -> dict[str, int]:
        """Objects encrypted and decrypted, refusals by reason, key epochs started."""
        with self._lock:
            return dict(self._counters)

    # -- internals --------------------------------------------------------------------------

    def _current_epoch(self) -> bytes:
        with self._lock:
            if self._epoch_left <= 0:
                self._epoch = os.urandom(EPOCH_SIZE)
                self._epoch_left = EPOCH_OBJECTS
                self._counters["key_epochs"] += 1
            self._epoch_left -= 1
            return self._epoch

    def _cipher(self, key_check: bytes, epoch: bytes, salt: str | None) -> AESGCM:
        slot = (key_check, epoch, salt)
        with self._lock:
            cipher = self._ciphers.get(slot)
            if cipher is not None:
                self._ciphers.move_to_end(slot)
                return cipher
        info = _DATA_LABEL if salt is None else _DATA_LABEL + b"\0" + salt.encode()
        cipher = AESGCM(_hkdf(self.__masters[key_check], KEY_SIZE, epoch, info))
        with self._lock:
            self._ciphers[slot] = cipher
            while len(self._ciphers) > _KEY_CACHE_SIZE:
                self._ciphers.popitem(last=False)
        return cipher

    def _count(self, name: str) -> None:
        with self._lock:
            self._counters[name] += 1

    def _refuse(self, counter: str, context: SerdeContext, reason: str) -> NoReturn:
        self._count(counter)
        log.debug("aesgcm: refused the frame of %s: %s", context.key, reason)
        raise AesGcmDecodeError(reason)
