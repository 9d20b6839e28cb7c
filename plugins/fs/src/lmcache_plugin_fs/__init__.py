"""L2 adapter ``fs``: one checksummed record file per object, in a directory or any fsspec
filesystem.  This manifest stays light: the implementation is imported when configured."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec

from lmcache_tiers.plugin import FieldError, KindRegistry, L2AdapterConfig, SizeGiB, check_size_gib, hookimpl

_GIB = 1 << 30
#: URL prefixes served by plain ``os`` calls rather than fsspec's file objects
_LOCAL_PREFIXES = ("file://", "local://")
#: a root that starts like a URL but lacks the ``//`` (``file:/x``, ``s3:bucket``): taken as a
#: local path it would be a relative directory named ``file:`` in the working directory
_SCHEME_WITHOUT_SLASHES = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):(?!//)")


class FsConfig(L2AdapterConfig):
    """One record file per object (core's header with an XXH3-128 checksum, verified on
    load) in a local directory or any fsspec URL (`memory://`, `s3://` with s3fs, ...).
    Files are published atomically, found again after a restart (the start-up scan counts
    what is on disk), and a damaged record is a miss that is removed and counted.

    LMCache compatibility: `base_path`, `relative_tmp_dir`, `use_odirect` and
    `read_ahead_size` are the fields of LMCache's own `fs` adapter, with the same
    meaning (`base_path` is an alias of `path`); `max_capacity_gb` is LMCache's
    `fs_native` field (0 = no capacity), except that here a capacity is enforced: stores
    beyond it are refused, and with `eviction` the oldest objects make room. The other
    fields are lmcache-tiers' own.
    """

    path: Annotated[
        str | None,
        msgspec.Meta(description="Directory or fsspec URL holding the records; created if missing."),
    ] = None
    base_path: Annotated[
        str | None,
        msgspec.Meta(description="LMCache alias of path (LMCache's fs field name); give one of the two."),
    ] = None
    relative_tmp_dir: Annotated[
        str | None,
        msgspec.Meta(
            description="LMCache fs field: sub-directory of the root for files being written "
            "(default: next to their record). Must be on the same filesystem."
        ),
    ] = None
    use_odirect: Annotated[
        bool | Literal["auto"],
        msgspec.Meta(
            description="LMCache fs field: O_DIRECT reads and writes, bypassing the page cache "
            '(local paths only; buffers are page-aligned). "auto": O_DIRECT where the '
            "directory's filesystem takes it, the page cache elsewhere (tmpfs, fsspec URLs); "
            'the embedded default L2 uses "auto".'
        ),
    ] = False
    read_ahead_size: Annotated[
        Annotated[int, msgspec.Meta(gt=0)] | None,
        msgspec.Meta(
            description="LMCache fs field: read this many payload bytes first (with the header), to "
            "start the filesystem's read-ahead, then the rest in 1 MiB pieces (buffered reads; the "
            "read block size for fsspec).",
        ),
    ] = None
    max_capacity_gb: Annotated[
        SizeGiB,
        msgspec.Meta(
            ge=0.0,
            description="LMCache fs_native field: most GiB of payload held; 0 = unbounded (usage -1.0). "
            "Required for eviction.",
        ),
    ] = 0.0
    recover_on_start: Annotated[
        bool,
        msgspec.Meta(
            description="Serve the records an earlier run left (the start-up scan accounts them); "
            "false removes them when the adapter starts."
        ),
    ] = True
    persist_enabled: Annotated[
        bool,
        msgspec.Meta(description="Keep the records at shutdown; false removes them when the adapter closes."),
    ] = True
    shard_dirs: Annotated[
        bool,
        msgspec.Meta(
            description="Two-level directories <root>/ab/cd/ named from the chunk hash, not one flat one."
        ),
    ] = False
    fsync: Annotated[
        bool,
        msgspec.Meta(
            description="fsync each record before publishing it (and its directory after), so a store "
            "survives a power loss; off, a torn record after a crash fails its checksum and is a miss. "
            "Local directories only: fsspec has no fsync, an fsspec store's durability is its own."
        ),
    ] = False
    storage_options: Annotated[
        dict[str, Any],
        msgspec.Meta(description="Options for the fsspec filesystem of a URL (e.g. s3fs credentials)."),
    ] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        check_size_gib("max_capacity_gb", self.max_capacity_gb)
        if (self.path is None) == (self.base_path is None):
            # neither: the field to give is path; both: the alias is the one too many
            field = "base_path" if self.path is not None else "path"
            raise FieldError(
                field, "give the directory as path (or LMCache's base_path), exactly one of them"
            )
        # file:// alone names no directory: opened, it would be the working directory
        if not (self.local_root if self.is_local else self.root).strip():
            raise FieldError(
                "path" if self.path is not None else "base_path", "the directory must not be empty"
            )
        self._refuse_url_without_slashes()
        self._refuse_shard_shaped_root()
        if self.relative_tmp_dir is not None:
            from lmcache_tiers.plugin import check_relative_dir

            try:
                check_relative_dir(self.relative_tmp_dir)
            except ValueError as exc:
                raise FieldError("relative_tmp_dir", f"relative_tmp_dir {exc}") from None
        if self.use_odirect is True and not self.is_local:
            from lmcache_tiers.plugin import redact_url_secrets

            raise FieldError(
                "use_odirect",
                f"use_odirect applies to local directories only, not {redact_url_secrets(self.root)!r}",
            )
        if self.fsync and not self.is_local:
            from lmcache_tiers.plugin import redact_url_secrets

            # fsspec has no fsync: taken, the store would be acknowledged as durable
            # (the field's promise) on whatever the filesystem's close and move give
            # (an sftp or smb server's page cache), and lost to its power loss.
            raise FieldError(
                "fsync",
                f"fsync applies to local directories only, not {redact_url_secrets(self.root)!r}: "
                "an fsspec store's durability is its own; leave fsync unset",
            )
        if self.eviction is not None and not self.max_capacity_gb > 0:
            raise FieldError(
                "eviction",
                "eviction needs a capacity: set max_capacity_gb > 0 (it is what eviction keeps under)",
            )
        if self.storage_options and self.is_local:
            raise FieldError(
                "storage_options", "storage_options apply to fsspec URLs, not to local directories"
            )

    def _refuse_url_without_slashes(self) -> None:
        """``file:/x`` has no ``://``, so it would be a local path: the cache would go to a
        directory ``file:`` under whatever the working directory is, a restart from
        elsewhere would not find it, and ``/x`` would stay empty.  Refused, with the URL
        that was probably meant; ``./`` in front names such a directory on purpose."""
        root = self.root
        scheme = _SCHEME_WITHOUT_SLASHES.match(root)
        if "://" in root or scheme is None:
            return
        from lmcache_tiers.plugin import redact_url_secrets

        name = scheme.group(1)
        rest = root[scheme.end() :]
        # file:/x is /x (file:///x); other schemes take a bucket or host after the //
        meant = f"{name}://{rest if f'{name}://' in _LOCAL_PREFIXES else rest.lstrip('/')}"
        field = "path" if self.path is not None else "base_path"
        raise FieldError(
            field,
            f"{field} starts with '{name}:' but not '{name}://', so it would be a local path "
            f"relative to the working directory; did you mean {redact_url_secrets(meant)!r}? "
            "(for a directory of that name, write ./ before it)",
        )

    def _refuse_shard_shaped_root(self) -> None:
        """A root ``<outer>/ab/cd`` (two shard names) cannot be told from a shard directory
        of a sharded store at ``<outer>``, whose listing would account its records and
        whose sweeps would remove its writes in flight and, with persistence off, its
        acknowledged records.  Whether ``<outer>`` is a store is not known here (it may
        be another server's, or start later): such a root is refused."""
        from lmcache_tiers.plugin import FileLayout, redact_url_secrets

        if self.is_local:  # the directory as given, or where its symlinks lead
            found = FileLayout.shard_shaped_local_root(self.local_root)
        else:
            root = self.root.rstrip("/")
            part = FileLayout.shard_shaped_part(root)
            found = None if part is None else (root, part)
        if found is None:
            return
        root, shard_shaped = found
        outer = root[: -len(shard_shaped) - 1] or "/"
        raise FieldError(
            "path" if self.path is not None else "base_path",
            f"{redact_url_secrets(self.root)!r} is named like a shard directory ({shard_shaped}) "
            f"of a sharded fs store at {redact_url_secrets(outer)!r}, whose listing and sweeps would "
            "take its records; "
            "choose a directory whose last two names are not both two hex digits",
        )

    @property
    def root(self) -> str:
        """The directory or URL given, whichever field named it."""
        return self.path if self.path is not None else (self.base_path or "")

    @property
    def is_local(self) -> bool:
        root = self.root
        return "://" not in root or root.startswith(_LOCAL_PREFIXES)

    @property
    def local_root(self) -> str:
        root = self.root
        for prefix in _LOCAL_PREFIXES:
            if root.startswith(prefix):
                root = root[len(prefix) :]
        return root

    @property
    def capacity_bytes(self) -> int | None:
        return int(self.max_capacity_gb * _GIB) if self.max_capacity_gb > 0 else None


@hookimpl
def tiers_register_l2_adapters(registry: KindRegistry) -> None:
    registry.add("fs", "lmcache_plugin_fs.backend:FsBackend", FsConfig)
