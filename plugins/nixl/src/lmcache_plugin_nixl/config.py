"""Configuration Structs of the two NIXL adapter types.

They accept the JSON LMCache users already write: NIXL-specific options travel as strings
in ``backend_params`` (``"use_direct_io": "false"``, ``"max_capacity_gb": "10"``), so they
are parsed and checked here, in ``__post_init__``; each refusal is a ``FieldError`` naming
the value, so the error carries its full path (``$.l2_adapters[0].backend_params.file_path``).
Keys this adapter does not consume are handed to NIXL's ``create_backend`` as the
backend's own init parameters (``use_uring``, ``bucket``, ...) and are checked against
what the NIXL plugin advertises when the adapter starts.

This module is imported whenever plugins are listed, so it must not import NIXL.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, cast

import msgspec

from lmcache_tiers.plugin import FieldError, L2AdapterConfig, check_size_gib

#: Every NIXL storage backend the adapters know, in the order the docs list them.
BACKENDS: tuple[str, ...] = ("POSIX", "GDS", "GDS_MT", "HF3FS", "OBJ", "AZURE_BLOB")

#: Backends that read and write files on a mounted filesystem.
FILE_BACKENDS: frozenset[str] = frozenset({"POSIX", "GDS", "GDS_MT", "HF3FS"})
#: Backends that address objects in a remote store (S3-compatible, Azure Blob).
OBJECT_BACKENDS: frozenset[str] = frozenset({"OBJ", "AZURE_BLOB"})

_GIB = 1 << 30
_TRUE = "true"
_FALSE = "false"

# backend_params keys consumed by the adapters themselves (never passed to NIXL).
_FILE_KEYS = ("file_path", "use_direct_io")
_DYNAMIC_KEYS = ("max_capacity_gb", "shard_dirs")
#: the field a file backend's directory is named by in errors
FILE_PATH_FIELD = "backend_params.file_path"


def _parse_bool(params: dict[str, str], key: str, *, default: str | None) -> bool:
    raw = params.get(key, default)
    if raw is None:
        raise FieldError(f"backend_params.{key}", f'backend_params.{key} is required: "true" or "false"')
    value = raw.strip().lower()
    if value not in (_TRUE, _FALSE):
        raise FieldError(
            f"backend_params.{key}", f'backend_params.{key} must be "true" or "false", got {raw!r}'
        )
    return value == _TRUE


def _require_file_path(params: dict[str, str], backend: str) -> str:
    path = params.get("file_path", "").strip()
    if not path:
        raise FieldError(
            "backend_params.file_path",
            f"backend_params.file_path is required for the {backend} backend: "
            "the directory that holds the cache files",
        )
    return path


def _check_backend_name(backend: str) -> None:
    # A plain str (not a Literal) so the error can list the choices and catch lower case.
    if backend not in BACKENDS:
        hint = f"; did you mean {backend.upper()!r}?" if backend.upper() in BACKENDS else ""
        raise FieldError("backend", f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}{hint}")


def _check_file_backend(params: dict[str, str], backend: str) -> None:
    _require_file_path(params, backend)
    _parse_bool(params, "use_direct_io", default=None)


#: backend_params naming an object store's endpoint, where credentials must not be written
_ENDPOINT_KEYS = ("endpoint_override", "account_url")


def _refuse_shard_shaped_directory(file_path: str) -> None:
    """A directory ``<outer>/ab/cd`` (two shard names) cannot be told from a shard
    directory of a sharded fs or nixl_store_dynamic store at ``<outer>``: that store's
    listing would account these records, its start-up sweep remove the writes in flight
    and its removal of every record (``persist_enabled: false``) the acknowledged ones.
    Whether ``<outer>`` is a store is not known here (it may start later): refused."""
    from lmcache_tiers.plugin import FileLayout  # core's file-store code, loaded only for this

    found = FileLayout.shard_shaped_local_root(file_path)  # as given, or where links lead
    if found is None:
        return
    shard_shaped = found[1]
    raise FieldError(
        FILE_PATH_FIELD,
        f"backend_params.file_path {file_path!r} is named like a shard directory ({shard_shaped}) "
        "of a sharded store in the directory two levels up, whose listing and sweeps would take "
        "its records; choose a directory whose last two names are not both two hex digits",
    )


def _refuse_credentials_in_endpoints(params: dict[str, str]) -> None:
    """``user:password@host`` in an endpoint (with or without a scheme) would be printed
    by ``--print-config`` and named by the start-up probe; NIXL takes the credentials as
    their own keys.  The refusal does not quote the value."""
    for key in _ENDPOINT_KEYS:
        value = str(params.get(key, ""))
        authority = value.partition("://")[2] if "://" in value else value
        if "@" in authority.split("/", 1)[0].split("?", 1)[0]:
            raise FieldError(
                f"backend_params.{key}",
                f"credentials are not accepted in backend_params.{key}; give them as "
                "access_key and secret_key (OBJ) or in connection_string (AZURE_BLOB)",
            )


def connection_string_fields(connection_string: str) -> dict[str, str]:
    """The ``Name=value`` fields of an Azure storage connection string."""
    return dict(part.split("=", 1) for part in connection_string.split(";") if "=" in part)


def _check_azure_service_named(params: dict[str, str]) -> None:
    """Without ``account_url``, the connection string must say where the blob service
    is (``BlobEndpoint``, or ``AccountName`` for Azure's own), as the SDK requires; the
    refusal does not quote it (it holds the account key)."""
    if params.get("account_url"):
        return
    fields = connection_string_fields(params.get("connection_string", ""))
    if not (fields.get("BlobEndpoint", "").strip() or fields.get("AccountName", "").strip()):
        raise FieldError(
            "backend_params.connection_string",
            "backend_params.connection_string names neither BlobEndpoint nor AccountName, so "
            "the blob service it is for cannot be told; give one of them (or account_url)",
        )


def _check_object_backend(params: dict[str, str], backend: str) -> None:
    _refuse_credentials_in_endpoints(params)
    for key in _FILE_KEYS:
        if key in params:
            raise FieldError(
                f"backend_params.{key}",
                f"backend_params.{key} does not apply to the {backend} backend, "
                "which stores objects, not files",
            )
    if backend == "AZURE_BLOB":
        if not (params.get("account_url") or params.get("connection_string")):
            raise FieldError(
                "backend_params.account_url",
                "backend_params.account_url is required for the AZURE_BLOB backend "
                "(or connection_string, e.g. for Azurite)",
            )
        _check_azure_service_named(params)
        if not params.get("container_name"):
            raise FieldError(
                "backend_params.container_name",
                "backend_params.container_name is required for the AZURE_BLOB backend",
            )


def _as_string(value: str | bool | int | float) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


class _NixlBase(L2AdapterConfig):
    backend: Annotated[str, msgspec.Meta(description="NIXL backend: " + ", ".join(BACKENDS) + ".")]
    backend_params: Annotated[
        dict[str, str | bool | int | float],
        msgspec.Meta(
            description=(
                "String options. File backends need file_path (the directory) and use_direct_io "
                '("true" or "false"); nixl_store_dynamic also needs max_capacity_gb (GiB) and '
                'takes shard_dirs (default "false"). Other keys go to NIXL (AZURE_BLOB needs '
                "account_url or connection_string, and container_name). "
                'Bare JSON numbers and booleans are taken as their string form ("10", "false"), '
                "as LMCache does."
            )
        ),
    ] = msgspec.field(default_factory=dict)

    def _params_as_strings(self) -> None:
        """NIXL takes string parameters; LMCache's JSON may give ``false`` or ``10`` bare."""
        if any(not isinstance(value, str) for value in self.backend_params.values()):
            msgspec.structs.force_setattr(
                self, "backend_params", {key: _as_string(value) for key, value in self.backend_params.items()}
            )

    @property
    def string_params(self) -> dict[str, str]:
        """``backend_params`` as ``__post_init__`` left it: every value a string."""
        return cast("dict[str, str]", self.backend_params)

    @property
    def is_file_backend(self) -> bool:
        return self.backend in FILE_BACKENDS

    @property
    def file_path(self) -> str:
        """Directory of the cache files (file backends only)."""
        return self.string_params.get("file_path", "").strip()

    def preflight(self) -> None:
        """Before L1 exists: a file backend's directory must be one this user can use."""
        if self.is_file_backend:
            from lmcache_tiers.plugin import check_directory

            check_directory(self.file_path, FILE_PATH_FIELD)

    @property
    def use_direct_io(self) -> bool:
        return self.is_file_backend and _parse_bool(self.string_params, "use_direct_io", default=_FALSE)

    def nixl_init_params(self) -> dict[str, str]:
        """``backend_params`` minus the adapter's own keys: what NIXL's plugin receives."""
        own = set(_FILE_KEYS) | set(_DYNAMIC_KEYS)
        return {k: v for k, v in self.string_params.items() if k not in own}


class NixlStoreConfig(_NixlBase):
    """NIXL L2 adapter over a pool of storage descriptors preallocated at start-up.

    ``pool_size`` files (file backends) or objects (OBJ, AZURE_BLOB) are created and
    registered with NIXL once; each holds one cached object. When every slot is taken,
    stores are reported as not stored until eviction or deletes free slots. The pool
    lives only as long as the server: nothing is recovered after a restart.
    """

    #: LMCache's persist_enabled (true by default there) asks for records found again after
    #: a restart, which this pool never does
    lmcache_unsupported: ClassVar[dict[str, str]] = {
        "persist_enabled": "the slot pool lives as long as the server: nothing is found again "
        "after a restart (nixl_store_dynamic keeps its files; leave the field out)",
    }

    pool_size: Annotated[
        int,
        msgspec.Meta(gt=0, le=1 << 20, description="Number of storage slots: the most objects held at once."),
    ]

    def __post_init__(self) -> None:
        self._params_as_strings()
        _check_backend_name(self.backend)
        params = self.string_params
        if self.backend in FILE_BACKENDS:
            _check_file_backend(params, self.backend)
        else:
            _check_object_backend(params, self.backend)
        for key in _DYNAMIC_KEYS:
            if key in params:
                raise FieldError(
                    f"backend_params.{key}",
                    f"backend_params.{key} applies to nixl_store_dynamic only; "
                    "nixl_store holds at most pool_size objects",
                )


class NixlStoreDynamicConfig(_NixlBase):
    """NIXL L2 adapter storing one checksummed file per object, kept across restarts.

    Files are opened and registered with NIXL per operation, published atomically
    (temporary file, then rename) and found again after a restart by their deterministic
    name. Usage is the bytes stored over ``backend_params.max_capacity_gb``; stores that
    would exceed it are refused. File backends only (POSIX, GDS, GDS_MT, HF3FS).
    """

    persist_enabled: Annotated[
        bool,
        msgspec.Meta(
            description="Keep the files at shutdown and find them after a restart; false deletes them all."
        ),
    ] = True

    def __post_init__(self) -> None:
        self._params_as_strings()
        _check_backend_name(self.backend)
        if self.backend in OBJECT_BACKENDS:
            raise FieldError(
                "backend",
                f"backend {self.backend!r} is not supported by nixl_store_dynamic, which "
                "stores one file per object; use a file backend (POSIX, GDS, GDS_MT, HF3FS) "
                f"or the nixl_store type for {self.backend}",
            )
        params = self.string_params
        _check_file_backend(params, self.backend)
        self.max_capacity_bytes  # noqa: B018 - parses and validates max_capacity_gb
        _parse_bool(params, "shard_dirs", default=_FALSE)
        _refuse_shard_shaped_directory(self.file_path)

    @property
    def max_capacity_bytes(self) -> int:
        raw = self.string_params.get("max_capacity_gb")
        if raw is None:
            raise FieldError(
                "backend_params.max_capacity_gb",
                "backend_params.max_capacity_gb is required for nixl_store_dynamic: "
                'the most gigabytes (GiB) of objects it may hold, e.g. "10"',
            )
        try:
            gigabytes = float(raw)
        except ValueError:
            raise FieldError(
                "backend_params.max_capacity_gb",
                f"backend_params.max_capacity_gb must be a number, got {raw!r}",
            ) from None
        if not gigabytes > 0 or gigabytes == float("inf"):
            raise FieldError(
                "backend_params.max_capacity_gb",
                f"backend_params.max_capacity_gb must be a positive number, got {raw!r}",
            )
        # A positive size under one byte would be a capacity of 0: every store refused.
        check_size_gib("backend_params.max_capacity_gb", gigabytes)
        return int(gigabytes * _GIB)

    @property
    def shard_dirs(self) -> bool:
        return _parse_bool(self.string_params, "shard_dirs", default=_FALSE)
