"""Serde ``aesgcm``: AES-256-GCM encryption of each object, bound to its key."""

from __future__ import annotations

import os
import re
from typing import Annotated

import msgspec

from lmcache_plugin_serde_aesgcm.keys import is_key_itself
from lmcache_tiers.plugin import ComponentConfig, KindRegistry, hookimpl

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class AesGcmConfig(ComponentConfig):
    """AES-256-GCM per object: a fresh random 96-bit nonce each time, the full object key,
    the length and the serde chain as associated data (an object copied under another key,
    or a record naming another chain, fails to decrypt), so a remote store holds only
    ciphertext and any tampering reads as a miss.

    The configuration names where the 256-bit key is (a file or an environment variable),
    never the key itself, so printed configs and logs cannot leak it.  The key is read once
    at start-up; a missing, unreadable or malformed key stops the server with one line.
    """

    key_file: Annotated[
        str | None,
        msgspec.Meta(
            description="File holding the 256-bit key: 32 raw bytes, 64 hex digits or base64 "
            "(keep it mode 0600; a looser mode is logged as a warning)."
        ),
    ] = None
    key_env: Annotated[
        str | None,
        msgspec.Meta(description="Environment variable holding the key as 64 hex digits or base64."),
    ] = None
    read_key_files: Annotated[
        list[str],
        msgspec.Meta(
            description="Retired keys, in files of key_file's formats, that still decrypt the frames "
            "written under them (counted as retired_key_frames_read) after a key rotation; new "
            "frames are always written under key_file or key_env."
        ),
    ] = []
    read_key_envs: Annotated[
        list[str],
        msgspec.Meta(
            description="Retired keys in environment variables (as key_env), read like read_key_files."
        ),
    ] = []
    per_salt_keys: Annotated[
        bool,
        msgspec.Meta(
            description="Derive a separate key per cache_salt (HKDF-SHA256), so tenants never share "
            "a key; records say which way they were written, so either setting reads both."
        ),
    ] = True
    read_unbound_frames: Annotated[
        bool,
        msgspec.Meta(
            description="Read frames of versions 1 and 2, written before the serde chain was "
            "authenticated (counted as unbound_frames_read); false refuses them "
            "(unbound_frames_refused, a miss until stored again), which closes a record whose "
            "chain was rewritten, where one key serves several chains."
        ),
    ] = True

    def __post_init__(self) -> None:
        if (self.key_file is None) == (self.key_env is None):
            raise ValueError("exactly one of key_file or key_env must be set")
        self._refuse_a_key_in_place_of_its_location()
        if self.key_file is not None and not self.key_file.strip():
            raise ValueError("key_file is empty")
        if any(not path.strip() for path in self.read_key_files):
            raise ValueError("read_key_files holds an empty path")
        for field, names in (("key_env", [self.key_env]), ("read_key_envs", self.read_key_envs)):
            if any(name is not None and not _ENV_NAME.match(name) for name in names):
                # Not quoted: what is no variable name may be a key in an encoding the check
                # above does not know (``0x`` hex, URL-safe base64, another length).
                raise ValueError(
                    f"{field} is not an environment variable name (letters, digits and _, "
                    "not starting with a digit)"
                )

    def _refuse_a_key_in_place_of_its_location(self) -> None:
        """The key itself written as ``key_env`` or ``key_file`` (a common slip) would be
        quoted by the errors below and printed by ``--print-config``: refuse it unquoted.
        An existing file is a file, whatever its name."""
        field = _key_in_place_of_a_variable("key_env", [self.key_env] if self.key_env else [])
        field = field or _key_in_place_of_a_file("key_file", [self.key_file] if self.key_file else [])
        field = field or _key_in_place_of_a_variable("read_key_envs", self.read_key_envs)
        field = field or _key_in_place_of_a_file("read_key_files", self.read_key_files)
        if field is None:
            return
        raise ValueError(
            f"{field} holds a 256-bit key itself, not where the key is: put the key in "
            "a file (key_file) or an environment variable (key_env) and name that instead"
        )


def _key_in_place_of_a_variable(field: str, names: list[str]) -> str | None:
    """``field`` when one of its variable names is a key itself, else None."""
    return field if any(is_key_itself(name) for name in names) else None


def _key_in_place_of_a_file(field: str, paths: list[str]) -> str | None:
    """``field`` when one of its paths is a key itself (and no such file exists: an existing
    file is a file, whatever its name), else None."""
    for path in paths:
        if is_key_itself(path) and not os.path.exists(os.path.expanduser(path)):
            return field
    return None


@hookimpl
def tiers_register_serdes(registry: KindRegistry) -> None:
    registry.add(
        "aesgcm",
        "lmcache_plugin_serde_aesgcm.cipher:AesGcmSerde",
        AesGcmConfig,
        install_hint="pip install lmcache-plugin-serde-aesgcm",
    )
