"""The ``aesgcm`` serde: AES-256-GCM frames bound to the object key.

Frame layout::

    magic "LTAG" | version u8 | flags u8 | reserved u16 | key check 8B | epoch 16B
    | nonce 12B | ciphertext | tag 16B

Keys.  Nothing is encrypted under the configured master key itself.  Each frame is
encrypted under ``HKDF-SHA256(master, salt=epoch, info=label [+ cache_salt])``: ``epoch``
is 16 random bytes a serde instance picks at start and again after every
``EPOCH_OBJECTS`` encryptions, which keeps the number of random 96-bit nonces drawn under
one key far below the 2^32 that NIST SP 800-38D allows, however long a server runs;
``cache_salt`` (flag bit 0) gives every tenant its own key.  ``key check`` is 8 bytes
derived from the master key alone, so a frame written under another master key is
reported as such instead of as tampering.

Associated data: the 44 header bytes, the plaintext length (u64) and the full object key
(``ObjectKey.to_bytes()``).  A frame moved under another key, a changed flag or epoch, a
truncated or extended frame and any flipped bit all fail authentication: decode raises,
and the adapter counts the object as a miss.
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
from lmcache_tiers.plugin import ObjectKey, SerdeContext

log = logging.getLogger("lmcache_tiers.serde.aesgcm")

MAGIC: Final = b"LTAG"
VERSION: Final = 1
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
    "key_epochs",
)


class AesGcmDecodeError(ValueError):
    """A frame that does not decrypt: damaged, tampered, moved, or under another key."""


def _hkdf(master: bytes, length: int, salt: bytes | None, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=salt, info=info).derive(master)


def _associated_data(header: bytes | memoryview, length: int, key: ObjectKey) -> bytes:
    return b"".join((header, length.to_bytes(8, "little"), key.to_bytes()))


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
        self.__master = master
        self._key_check = _hkdf(master, KEY_CHECK_SIZE, None, _CHECK_LABEL)
        self._lock = threading.Lock()
        self._ciphers: OrderedDict[tuple[bytes, str | None], AESGCM] = OrderedDict()
        self._counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self._epoch = b""
        self._epoch_left = 0

    def __repr__(self) -> str:
        source = (
            f"key_file={self.config.key_file!r}"
            if self.config.key_file
            else f"key_env={self.config.key_env!r}"
        )
        return f"AesGcmSerde({source}, per_salt_keys={self.config.per_salt_keys})"

    # -- Serde ------------------------------------------------------------------------------

    def max_encoded_size(self, size: int) -> int:
        return HEADER_SIZE + size + TAG_SIZE

    def encode(self, data: memoryview, context: SerdeContext) -> memoryview:
        view = memoryview(data).cast("B")
        flags = FLAG_PER_SALT if self.config.per_salt_keys else 0
        epoch = self._current_epoch()
        nonce = os.urandom(NONCE_SIZE)
        header = _HEADER.pack(MAGIC, VERSION, flags, 0, self._key_check, epoch, nonce)
        cipher = self._cipher(epoch, context.key.cache_salt if flags & FLAG_PER_SALT else None)
        frame = bytearray(HEADER_SIZE + view.nbytes + TAG_SIZE)
        frame[:HEADER_SIZE] = header
        cipher.encrypt_into(
            nonce, view, _associated_data(header, view.nbytes, context.key), memoryview(frame)[HEADER_SIZE:]
        )
        self._count("encrypted_objects")
        return memoryview(frame)

    def decode(self, data: memoryview, context: SerdeContext) -> memoryview:
        view = memoryview(data).cast("B")
        if view.nbytes < HEADER_SIZE + TAG_SIZE:
            self._refuse("corrupt_frames", context, f"{view.nbytes} bytes is shorter than an aesgcm frame")
        magic, version, flags, reserved, key_check, epoch, nonce = _HEADER.unpack_from(view)
        if magic != MAGIC or version != VERSION:
            self._refuse(
                "corrupt_frames", context, f"not an aesgcm v{VERSION} frame (magic {bytes(magic)!r})"
            )
        if flags & ~FLAG_PER_SALT or reserved:
            self._refuse("corrupt_frames", context, f"unknown flags {flags:#x}/{reserved:#x}")
        if key_check != self._key_check:
            self._refuse("wrong_key", context, "encrypted under another master key (key check differs)")
        length = view.nbytes - HEADER_SIZE - TAG_SIZE
        cipher = self._cipher(epoch, context.key.cache_salt if flags & FLAG_PER_SALT else None)
        plaintext = bytearray(length)
        try:
            cipher.decrypt_into(
                nonce,
                view[HEADER_SIZE:],
                _associated_data(view[:HEADER_SIZE], length, context.key),
                memoryview(plaintext),
            )
        except InvalidTag:
            self._refuse(
                "auth_failures",
                context,
                "authentication failed: the frame was altered, truncated or stored under another key",
            )
        self._count("decrypted_objects")
        return memoryview(plaintext)

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

    def _cipher(self, epoch: bytes, salt: str | None) -> AESGCM:
        slot = (epoch, salt)
        with self._lock:
            cipher = self._ciphers.get(slot)
            if cipher is not None:
                self._ciphers.move_to_end(slot)
                return cipher
        info = _DATA_LABEL if salt is None else _DATA_LABEL + b"\0" + salt.encode()
        cipher = AESGCM(_hkdf(self.__master, KEY_SIZE, epoch, info))
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
