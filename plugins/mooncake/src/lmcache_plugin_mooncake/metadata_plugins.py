"""Whether the installed Mooncake client can reach the kind of metadata service configured.

Mooncake builds its metadata plugins in at compile time (etcd, redis and HTTP each behind
a build flag), and a client asked for a kind its build lacks aborts the whole process
(``Unable to find metadata storage plugin``) -- the non-CUDA 0.3.13 wheel has no redis
plugin.  Each plugin is a C++ class whose type name the library holds, so the library
file tells which kinds it has before a set-up is tried.
"""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any

#: the plugin class Mooncake uses for each URL scheme (a bare host:port is etcd's)
_PLUGIN_CLASS = {
    "http": b"HTTPStoragePlugin",
    "https": b"HTTPStoragePlugin",
    "etcd": b"EtcdStoragePlugin",
    "redis": b"RedisStoragePlugin",
}


def metadata_kind(metadata_server: str) -> str | None:
    """The plugin kind ``metadata_server`` asks for; None for ``P2PHANDSHAKE`` (no plugin)."""
    if metadata_server == "P2PHANDSHAKE":
        return None
    scheme, separator, _ = metadata_server.partition("://")
    return scheme if separator else "etcd"


def missing_metadata_plugin(module: Any, metadata_server: str) -> str | None:
    """Why the Mooncake client in ``module`` (``mooncake.store``) cannot reach
    ``metadata_server``, or None when it can or the library cannot be read to tell."""
    kind = metadata_kind(metadata_server)
    plugin = _PLUGIN_CLASS.get(kind or "")
    library = getattr(module, "__file__", None)
    if plugin is None or library is None:
        return None
    try:
        with Path(library).open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data.find(plugin) >= 0:
                return None
    except (OSError, ValueError):
        return None
    return (
        f"the installed Mooncake client ({library}) was built without its {kind} metadata plugin "
        f"and would abort the process; use a kind it has, e.g. the master's HTTP metadata server "
        f"(mooncake_master --enable_http_metadata_server, http://host:port/metadata)"
    )
