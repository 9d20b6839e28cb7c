"""Reading the 256-bit master key from a file or an environment variable.

Every error names where the key was looked for and what was wrong with it (its length,
its encoding), never any of its bytes.
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import stat

from lmcache_tiers.plugin import ConfigError

log = logging.getLogger("lmcache_tiers.serde.aesgcm")

KEY_SIZE = 32
#: a key file larger than this is certainly not a key (and is not read whole)
_MAX_KEY_FILE = 4096
#: what each source may hold, as its refusal says: a variable cannot hold raw bytes (NUL)
_EXPECTED_IN_FILE = "32 raw bytes, 64 hex digits or base64 of 32 bytes"
_EXPECTED_IN_VARIABLE = "64 hex digits or base64 of 32 bytes"


def _from_text(text: bytes) -> bytes | None:
    """The key encoded as hex or base64 (surrounding whitespace ignored), else None."""
    stripped = text.strip()
    if len(stripped) == 2 * KEY_SIZE:
        try:
            decoded = bytes.fromhex(stripped.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            return None
        # fromhex skips whitespace between digit pairs: 64 characters may hold fewer bytes.
        return decoded if len(decoded) == KEY_SIZE else None
    try:
        decoded = base64.b64decode(stripped, validate=True)
    except (binascii.Error, ValueError):
        return None
    return decoded if len(decoded) == KEY_SIZE else None


def is_key_itself(text: str) -> bool:
    """Whether ``text``, written where a key's location belongs, is a key: 64 hex digits
    or base64 of 32 bytes.  Such a value must be refused without being quoted."""
    return _from_text(text.encode("utf-8", "replace")) is not None


def _checked(key: bytes | None, where: str, found: str, expected: str = _EXPECTED_IN_FILE) -> bytes:
    if key is None:
        raise ConfigError(f"aesgcm: {where} holds no 256-bit key (expected {expected}; found {found})")
    if key == bytes(KEY_SIZE):
        raise ConfigError(f"aesgcm: {where} holds an all-zero key; generate one with `openssl rand -hex 32`")
    return key


#: the key files and modes warned about already (as given in the config, mode as read)
_warned_modes: set[tuple[str, int]] = set()


def read_key_file(path: str, field: str = "key_file") -> bytes:
    """The key stored in ``path``: exactly 32 raw bytes, or 64 hex digits / base64 text;
    ``field`` names the config field in errors."""
    where = f"{field} {path!r}"
    try:
        # O_NONBLOCK: opening a FIFO would otherwise wait for a writer, and start-up with
        # it; a regular file reads the same either way, anything else is refused below.
        with open(os.path.expanduser(path), "rb", opener=_open_nonblocking) as handle:
            mode = os.fstat(handle.fileno()).st_mode
            if not stat.S_ISREG(mode):
                raise ConfigError(f"aesgcm: {where} is not a regular file")
            content = handle.read(_MAX_KEY_FILE + 1)
    except OSError as exc:
        raise ConfigError(f"aesgcm: {where} cannot be read: {exc.strerror or exc}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO) and (path, mode) not in _warned_modes:
        # once per file and mode: start-up reads each key twice (its checks, then the serde)
        _warned_modes.add((path, mode))
        log.warning(
            "aesgcm: %s is accessible to group or others (mode %03o); restrict it with chmod 600",
            where,
            stat.S_IMODE(mode),
        )
    if len(content) > _MAX_KEY_FILE:
        raise ConfigError(f"aesgcm: {where} is larger than {_MAX_KEY_FILE} bytes; it is not a key file")
    if len(content) == KEY_SIZE and _is_text(content):
        # 32 characters of text are no encoding of a 256-bit key (hex is 64, base64 44):
        # a passphrase, or hex of a 128-bit key, would make a weak key used as raw bytes.
        # 32 random bytes are all printable with probability (95/256)^32, about 1e-14.
        return _checked(None, where, "32 characters of text, not 32 random bytes")
    key = content if len(content) == KEY_SIZE else _from_text(content)
    return _checked(key, where, f"{len(content)} bytes")


def _open_nonblocking(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NONBLOCK)


def _is_text(content: bytes) -> bool:
    return all(0x20 <= byte < 0x7F for byte in content)


def read_key_env(name: str, field: str = "key_env") -> bytes:
    """The key in environment variable ``name`` (64 hex digits or base64); ``field`` names
    the config field in errors."""
    where = f"{field}: environment variable {name}"
    value = os.environ.get(name)
    if value is None:
        raise ConfigError(f"aesgcm: {where} is not set")
    key = _from_text(value.encode("utf-8", "replace"))
    return _checked(key, where, f"{len(value.strip())} characters", _EXPECTED_IN_VARIABLE)
