"""Configuration of the ``mooncake_store`` adapter (imported by the manifest: keep it light).

Field names are the ones LMCache's ``mooncake_store`` adapter passes to Mooncake's setup
(``local_hostname``, ``metadata_server``, ``master_server_address``, ``protocol``,
``global_segment_size``, ``local_buffer_size``) and its ``num_workers``; sizes are taken as
LMCache and Mooncake users write them: a number of bytes, the same as a string
(``"3355443200"``), or with a unit (``"4GB"``, ``"512 MiB"``).

LMCache's multi-process server forwards every other key of the adapter's JSON to
Mooncake's dictionary set-up, whose own name for the master is ``master_server_addr``:
that name is accepted as an alias, and each other set-up key Mooncake takes is refused in
one line saying why -- or accepted when it holds the value that asks for what is done
here anyway (``rdma_devices: ""``, ``enable_ssd_offload: false``, ...).
"""

from __future__ import annotations

import re
from typing import Annotated, ClassVar, Literal
from urllib.parse import urlsplit

import msgspec

from lmcache_tiers.plugin import FieldError, L2AdapterConfig, SizeGiB, check_size_gib

#: LMCache's defaults for the two sizes (its ``mooncake_store`` connector)
DEFAULT_SEGMENT_BYTES = 3355443200
DEFAULT_LOCAL_BUFFER_BYTES = 16 << 20
#: the smallest segment Mooncake mounts: its set-up refuses a smaller one (-600)
MIN_SEGMENT_BYTES = 16 << 20
#: Mooncake takes sizes as 64-bit unsigned integers
MAX_SIZE_BYTES = (1 << 64) - 1
#: mooncake_master's RPC service on this host (its default --rpc_port)
DEFAULT_MASTER_ADDRESS = "127.0.0.1:50051"
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_PREFIX = re.compile(r"^[A-Za-z0-9._:/-]{1,64}$")
_HOST_PORT = re.compile(r"^[A-Za-z0-9._\[\]:-]+:\d{1,5}$")
_SAFE_ADDRESS = re.compile(r"^[A-Za-z0-9._\[\]:/-]{0,300}$")
#: the kinds of metadata service Mooncake connects to by URL
_METADATA_SCHEMES = ("http", "https", "etcd", "redis")

Size = Annotated[
    int | str,
    msgspec.Meta(
        description="Bytes: a number, the same as a string, or with a unit (KB, MB, GB, TB; powers of 1024)."
    ),
]


def parse_size(value: int | str, field: str) -> int:
    """Bytes of a size field; ``FieldError`` naming ``field`` for anything else."""
    if isinstance(value, bool):
        raise FieldError(field, f"{value!r} is not a size")
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE.match(value)
        if match is None:
            raise FieldError(field, f"{value!r} is not a size (bytes, or a number with KB, MB, GB or TB)")
        size = int(match.group(1)) * _UNITS[match.group(2).lower()]
    if size < 0:
        raise FieldError(field, f"{value} is negative")
    if size > MAX_SIZE_BYTES:
        # Past it, Mooncake's set-up raised a TypeError on every connection attempt.
        raise FieldError(field, f"{value!r} is more bytes than Mooncake takes (at most 2**64 - 1)")
    return size


def _shown(address: str) -> str:
    """``address`` quoted for an error line when it holds only host:port characters; anything
    else (a query string, a token) is not echoed."""
    return repr(address) if _SAFE_ADDRESS.match(address) else "the value given"


def _url_error(value: str) -> str | None:
    """Why ``value``, a URL, has no host and valid port to connect to, or None."""
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError:
        return f"{_shown(value)} is not a valid URL (its host or port cannot be read)"
    if not parts.hostname:
        return f"{_shown(value)} is a URL without a host"
    if port == 0:
        return f"{_shown(value)}: the port is not 1..65535"
    return None


def _metadata_service_shape_error(value: str) -> str | None:
    """Why ``value`` names no metadata service Mooncake can reach, or None.  Mooncake
    takes ``P2PHANDSHAKE``, an http(s), etcd or redis URL, or etcd's bare ``host:port``
    endpoints (also after ``etcd://``), exactly as written: anything else (a URL missing
    its scheme or with a misspelt one, a host without a port) it retried at every set-up attempt, about ten
    seconds each, before failing, and a scheme it has no plugin for -- one in capitals,
    or after a space -- aborted the process."""
    if value == "P2PHANDSHAKE":
        return None
    if value != "".join(value.split()):
        return f"{_shown(value)} holds a space or a line break, which Mooncake would take as part of it"
    if "://" in value:
        scheme = value.partition("://")[0]
        if scheme not in _METADATA_SCHEMES:
            return f"{_shown(value)}: the scheme is not one of {', '.join(_METADATA_SCHEMES)} (in lower case)"
        if scheme != "etcd":
            return _url_error(value)
        # Mooncake hands what follows etcd:// to etcd's client as its endpoints: without a
        # port each set-up attempt stalled the server ~5 s and failed.
        if _endpoints_error(value) is not None:
            return f"{_shown(value)}: etcd:// takes host:port endpoints 1..65535 (etcd://host:2379)"
        return None
    return _endpoints_error(value)


def _endpoints_error(value: str) -> str | None:
    """Why ``value`` is not etcd's ``host:port`` endpoints (separated by , or ;, each
    perhaps after ``etcd://``), or None."""
    endpoints = [endpoint.removeprefix("etcd://") for endpoint in value.replace(";", ",").split(",")]
    if not all(_HOST_PORT.match(endpoint) for endpoint in endpoints):
        return (
            f"{_shown(value)} is neither a URL (http://host:port/metadata), host:port (etcd) nor P2PHANDSHAKE"
        )
    if not all(0 < int(endpoint.rpartition(":")[2]) < 65536 for endpoint in endpoints):
        return f"{_shown(value)}: a port is not 1..65535"
    return None


def _has_credentials(address: str) -> bool:
    """True when ``address`` carries a user or password (``scheme://user:pass@host``)."""
    if "://" in address:
        try:
            parts = urlsplit(address)
        except ValueError:  # refused by the URL checks, which must not echo a password
            return "@" in address
        return parts.username is not None or parts.password is not None
    return "@" in address


class MooncakeStoreConfig(L2AdapterConfig):
    """A Mooncake Store pool as the L2: objects are shared by every lmcache-tiers server
    (and any Mooncake client) connected to the same master, so a chunk one server stored
    is a hit on the others.

    The server joins the pool as a Mooncake client over the TCP transport and may lend it
    memory (``global_segment_size``); objects live in the segments of the clients that
    lend memory and vanish with them, and Mooncake evicts on its own when the pool fills:
    a vanished object is a miss.  Each object is stored as core's record (a fixed
    4096-byte header with its key and checksum, then the payload), so a damaged or
    foreign object is never handed out.  Credentials are not accepted in any field (they
    would show in ``--print-config``); Mooncake reads its own from its environment.
    """

    #: Mooncake set-up keys LMCache's adapter forwards that have no equivalent here -> why
    lmcache_unsupported: ClassVar[dict[str, str]] = {
        **dict.fromkeys(
            ("rdma_devices", "device_name"),
            "objects move over TCP (protocol tcp); there are no RDMA devices to choose",
        ),
        "ipc_socket_path": "the server joins the pool as a Mooncake client of its own, not through "
        "a local store service",
        **dict.fromkeys(
            ("enable_ssd_offload", "ssd_offload_path"),
            "Mooncake's SSD offload is not enabled; give the server a persistent L2 adapter instead",
        ),
        "tenant_id": "every server uses Mooncake's default tenant; key_prefix keeps deployments apart",
        **dict.fromkeys(
            ("enable_client_http_server", "client_http_port"),
            "the server's own /metrics and /status report this adapter",
        ),
    }
    #: those keys when they hold the value that asks for what is done here anyway (Mooncake's
    #: default for each; a path or port of a feature that is off does nothing either)
    lmcache_neutral_values: ClassVar[dict[str, object]] = {
        "rdma_devices": "",
        "device_name": "",
        "ipc_socket_path": "",
        "enable_ssd_offload": False,
        "ssd_offload_path": "",
        "tenant_id": "default",
        "enable_client_http_server": False,
        "client_http_port": 9300,
    }

    local_hostname: Annotated[
        str,
        msgspec.Meta(
            min_length=1,
            max_length=255,
            description=(
                "This server's name in the pool, which Mooncake names its segment after (adding "
                "a free port unless it ends in :port); other clients connect to "
                "MC_TCP_BIND_ADDRESS, else to the address the client finds on this host."
            ),
        ),
    ] = "127.0.0.1"
    metadata_server: Annotated[
        str,
        msgspec.Meta(
            min_length=1,
            max_length=1024,
            description=(
                "Mooncake's metadata service, handed to Mooncake as is: an http(s) or redis "
                "URL with a host (http://host:8080/metadata for mooncake_master "
                "--enable_http_metadata_server), etcd's host:port endpoints (bare or after "
                "etcd://), or P2PHANDSHAKE; a kind the installed Mooncake lacks is refused."
            ),
        ),
    ] = "http://127.0.0.1:8080/metadata"
    master_server_address: Annotated[
        str,
        msgspec.Meta(description="host:port of mooncake_master's RPC service (--rpc_port)."),
    ] = DEFAULT_MASTER_ADDRESS
    master_server_addr: Annotated[
        str | None,
        msgspec.Meta(
            description=(
                "Alias of `master_server_address`: Mooncake's own set-up key, which LMCache's "
                "multi-process server forwards as written."
            )
        ),
    ] = None
    protocol: Annotated[
        Literal["tcp"],
        msgspec.Meta(description="Mooncake transfer protocol; this adapter uses TCP (no RDMA)."),
    ] = "tcp"
    global_segment_size: Annotated[
        Size,
        msgspec.Meta(
            description=(
                "Memory this server lends to the pool, at least 16MiB (Mooncake's smallest "
                "segment); objects in it vanish when the server stops. 0: lend none (objects "
                "live in other clients' segments, e.g. mooncake_client)."
            )
        ),
    ] = DEFAULT_SEGMENT_BYTES
    local_buffer_size: Annotated[
        Size,
        msgspec.Meta(
            description=(
                "Mooncake's own transfer buffer; this adapter moves objects straight from and "
                "into L1, so it is only used by Mooncake internals."
            )
        ),
    ] = DEFAULT_LOCAL_BUFFER_BYTES
    num_workers: Annotated[
        int,
        msgspec.Meta(ge=1, le=64, description="Worker threads per operation kind (store, lookup, load)."),
    ] = 4
    key_prefix: Annotated[
        str,
        msgspec.Meta(
            description=(
                "Prefix of every object name in the pool; servers that share objects use the same "
                "one. Letters, digits and . _ : / - (1..64)."
            )
        ),
    ] = "lmcache_tiers/"
    max_capacity_gb: Annotated[
        SizeGiB,
        msgspec.Meta(
            ge=0.0,
            description=(
                "Bytes this adapter may hold, in GiB, counted by core; 0: no limit of its own "
                "(usage -1.0, no eviction; the pool evicts by itself)."
            ),
        ),
    ] = 0.0
    operation_timeout_s: Annotated[
        float,
        msgspec.Meta(
            gt=0.0,
            le=600.0,
            description=(
                "Longest a call to Mooncake may take: master RPCs and stalled transfers fail "
                "after it (Mooncake's own timeouts), and deletes and probes are given up."
            ),
        ),
    ] = 5.0
    master_metrics_url: Annotated[
        str | None,
        msgspec.Meta(
            description=(
                "URL of the master's HTTP metrics server (mooncake_master --metrics_port), e.g. "
                "http://host:9003: its key listing seeds usage at start. None: usage is learned "
                "from lookups."
            )
        ),
    ] = None

    def __post_init__(self) -> None:
        check_size_gib("max_capacity_gb", self.max_capacity_gb)
        for field in ("global_segment_size", "local_buffer_size"):
            parse_size(getattr(self, field), field)
        if 0 < self.segment_bytes < MIN_SEGMENT_BYTES:
            # Mooncake's set-up refuses it on every attempt, which read as a master not
            # answering.
            raise FieldError(
                "global_segment_size",
                f"{self.global_segment_size!r} is under Mooncake's smallest segment, 16MiB "
                f"({MIN_SEGMENT_BYTES} bytes); 0 lends none",
            )
        for field in ("metadata_server", "master_server_address", "master_server_addr", "master_metrics_url"):
            value = getattr(self, field)
            if value is not None and _has_credentials(value):
                raise FieldError(
                    field,
                    "credentials are not accepted here (they would show in --print-config and logs); "
                    "give them to Mooncake through its environment",
                )
        metadata_error = _metadata_service_shape_error(self.metadata_server)
        if metadata_error is not None:
            raise FieldError("metadata_server", metadata_error)
        given = "master_server_address" if self.master_server_addr is None else "master_server_addr"
        self._fold_master_alias()
        if not _HOST_PORT.match(self.master_server_address):
            raise FieldError(given, f"{_shown(self.master_server_address)} is not host:port")
        if not 0 < int(self.master_server_address.rpartition(":")[2]) < 65536:
            raise FieldError(given, f"{_shown(self.master_server_address)}: the port is not 1..65535")
        if not _PREFIX.match(self.key_prefix):
            raise FieldError("key_prefix", f"{self.key_prefix!r}: 1..64 of letters, digits and . _ : / -")
        if self.master_metrics_url is not None:
            if self.master_metrics_url.partition("://")[0] not in ("http", "https"):
                shown = _shown(self.master_metrics_url)
                raise FieldError("master_metrics_url", f"{shown} is not an http(s) URL")
            url_error = _url_error(self.master_metrics_url)
            if url_error is not None:
                raise FieldError("master_metrics_url", url_error)
        if self.eviction is not None and self.max_capacity_gb == 0:
            raise FieldError("eviction", "L2 eviction needs max_capacity_gb > 0 (0 means no limit)")

    def _fold_master_alias(self) -> None:
        alias = self.master_server_addr
        if alias is None:
            return
        # Given explicitly with the default's value, master_server_address cannot be told
        # from one left out: the alias wins then.
        if self.master_server_address not in (DEFAULT_MASTER_ADDRESS, alias):
            raise FieldError(
                "master_server_addr",
                f"master_server_addr {_shown(alias)} contradicts master_server_address "
                f"{_shown(self.master_server_address)}; give one of the two",
            )
        # Folded into the canonical field and cleared, so a printed config names the master
        # once and reads back (and edits) as the canonical field alone.
        msgspec.structs.force_setattr(self, "master_server_address", alias)
        msgspec.structs.force_setattr(self, "master_server_addr", None)

    @property
    def segment_bytes(self) -> int:
        return parse_size(self.global_segment_size, "global_segment_size")

    @property
    def local_buffer_bytes(self) -> int:
        return parse_size(self.local_buffer_size, "local_buffer_size")

    @property
    def capacity_bytes(self) -> int | None:
        return int(self.max_capacity_gb * (1 << 30)) or None
