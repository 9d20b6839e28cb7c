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
        if self.key_env is not None and not _ENV_NAME.match(self.key_env):
            # Not quoted: what is no variable name may be a key in an encoding the check
            # above does not know (``0x`` hex, URL-safe base64, another length).
            raise ValueError(
                "key_env is not an environment variable name (letters, digits and _, "
                "not starting with a digit)"
            )

    def _refuse_a_key_in_place_of_its_location(self) -> None:
        """The key itself written as ``key_env`` or ``key_file`` (a common slip) would be
        quoted by the errors below and printed by ``--print-config``: refuse it unquoted.
        An existing file is a file, whatever its name."""
        if self.key_env is not None and is_key_itself(self.key_env):
            field = "key_env"
        elif (
            self.key_file is not None
            and is_key_itself(self.key_file)
            and not os.path.exists(os.path.expanduser(self.key_file))
        ):
            field = "key_file"
        else:
            return
        raise ValueError(
            f"{field} holds a 256-bit key itself, not where the key is: put the key in "
            "a file (key_file) or an environment variable (key_env) and name that instead"
        )


@hookimpl
def tiers_register_serdes(registry: KindRegistry) -> None:
    registry.add(
        "aesgcm",
        "lmcache_plugin_serde_aesgcm.cipher:AesGcmSerde",
        AesGcmConfig,
        install_hint="pip install lmcache-plugin-serde-aesgcm",
    )
