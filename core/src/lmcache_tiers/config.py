"""Configuration: msgspec Structs for the server, L1, eviction and L2 adapter specs.

An adapter spec is JSON with a ``type`` that selects the plugin's own Struct, so the set of
valid adapter configurations is the union of what is installed.  Decoding is two-step
(read ``type``, then decode the rest into that plugin's Struct) so an unknown type can get
a "did you mean" answer and every other mistake keeps msgspec's path.

Typing rule, the same for ``--l2-adapter`` JSON, the ``--config`` TOML file and flags: a
value has the type its field declares, as in LMCache's own adapter configs.  A number is
written as a number (``0.5``, not ``"0.5"``), a switch as ``true``/``false``, text as a
string; NIXL's ``backend_params`` is a map of strings (``"max_capacity_gb": "10"``).
Flags are text parsed as the field's type.  Every refusal names the full path of the
value (``$.l2_adapters[0].backend_params.max_capacity_gb``) and, when the value only has
the wrong quoting, how to write it.
"""

from __future__ import annotations

import json
import math
import os
import re
import select
import stat
import sys
import time
import typing
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
from msgspec import Meta

from lmcache_tiers.endpoints import rpc_endpoint
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.registry import ComponentRegistry, Kind

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


class _KeywordOnly(msgspec.StructMeta):
    """Makes every subclass keyword-only, which msgspec does not inherit by itself.

    ``frozen`` and ``forbid_unknown_fields`` are inherited by msgspec; ``kw_only`` applies
    only to the fields a class defines, so without this every subclass would repeat it.
    """

    def __new__(mcls, name: str, bases: tuple[type, ...], namespace: dict[str, Any], **options: Any) -> Any:
        options.setdefault("kw_only", True)
        return super().__new__(mcls, name, bases, namespace, **options)


if TYPE_CHECKING:
    # Type checkers read dataclass_transform, not metaclasses: this declaration tells them
    # what the metaclass does at run time (subclasses are keyword-only and frozen).
    from typing_extensions import dataclass_transform

    @dataclass_transform(kw_only_default=True, frozen_default=True, field_specifiers=(msgspec.field,))
    class ComponentConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
        """Base of every config Struct: keyword-only, immutable, unknown fields refused."""

else:

    class ComponentConfig(
        msgspec.Struct, metaclass=_KeywordOnly, kw_only=True, frozen=True, forbid_unknown_fields=True
    ):
        """Base of every config Struct: keyword-only, immutable, unknown fields refused.

        Subclasses inherit all three flags: ``class MyConfig(ComponentConfig):`` is enough.
        """


#: the most GiB a size in a config may be (an exbibyte): every real size fits, and its bytes
#: stay a 64-bit number
MAX_GIB = float(1 << 30)
#: a size in GiB; a field adds its own lower bound: ``Annotated[SizeGiB, Meta(gt=0.0, ...)]``
SizeGiB = Annotated[float, Meta(le=MAX_GIB)]


class L2EvictionConfig(ComponentConfig):
    """Per-adapter L2 eviction: evict when usage reaches the watermark."""

    eviction_policy: Annotated[str, Meta(description="Eviction policy name, e.g. LRU.")] = "LRU"
    trigger_watermark: Annotated[
        float, Meta(gt=0.0, le=1.0, description="Usage fraction at which eviction starts.")
    ] = 0.8
    eviction_ratio: Annotated[
        float, Meta(gt=0.0, le=1.0, description="Fraction of used bytes freed per eviction round.")
    ] = 0.2


class CircuitConfig(ComponentConfig):
    """Circuit breaker of one adapter's backend: after repeated failures lookups miss at
    once, stores are skipped and loads fail, until a background probe finds the backend
    answering again."""

    enabled: Annotated[
        bool | None,
        Meta(description="On or off; null: on for backends that declare themselves remote."),
    ] = None
    failure_threshold: Annotated[
        int, Meta(ge=1, description="Consecutive failed backend calls that open the circuit.")
    ] = 5
    probe_interval_s: Annotated[
        float, Meta(gt=0.0, le=3600.0, description="Seconds between probes of the backend while open.")
    ] = 1.0
    call_timeout_s: Annotated[
        Annotated[float, Meta(gt=0.0, le=3600.0)] | None,
        Meta(
            description="Longest a lookup or probe waits for the backend before it counts as a failed "
            "call (a lookup is then all misses); null: only the backend's own timeouts. Stores and "
            "loads are always bounded by the backend's own timeouts.",
        ),
    ] = None


class SerdeSpec(ComponentConfig):
    """One serde transform of an adapter's chain, resolved from ``{"type": ..., ...}``."""

    type: str
    config: msgspec.Struct


class L2AdapterConfig(ComponentConfig):
    """Options every L2 adapter accepts; adapter plugins subclass this Struct."""

    eviction: Annotated[
        L2EvictionConfig | None,
        Meta(description="Per-adapter eviction; null means the adapter is never evicted from."),
    ] = None
    serde: Annotated[
        tuple[dict[str, Any], ...],
        Meta(
            description='Serde chain applied on the way to L2: a list of {"type": NAME, ...} '
            "objects naming installed serde plugins (`lmcache-tiers plugins list`)."
        ),
    ] = ()
    circuit: Annotated[
        CircuitConfig | None,
        Meta(description="Circuit breaker of the backend; null: the defaults (on for remote backends)."),
    ] = None


#: fields LMCache's server reads from every ``--l2-adapter`` JSON object that have no
#: equivalent here -> why (an adapter's own are in its Struct's ``lmcache_unsupported``)
LMCACHE_COMMON_UNSUPPORTED: dict[str, str] = {
    "shared": "it labels cache events for LMCache's coordinator, and servers here report to none",
    "per_op_workers": "worker threads are set per adapter (num_workers, where the adapter has it)",
    "affinity_tag": 'there is one L1, so the only tag is "_default"',
    # Adapters that keep files (fs, dax, nixl_store_dynamic) have the field and take both values.
    "persist_enabled": "this adapter has no choice of keeping or removing what it holds at "
    "shutdown: that is up to its backend (true is accepted)",
}

#: LMCache fields accepted when they hold the value that asks for what is done here anyway:
#: LMCache's own defaults, ``shared: false`` (no coordinator to tell) and ``persist_enabled:
#: true`` (nothing removed at shutdown).  An adapter adds its own in its Struct's
#: ``lmcache_neutral_values``; a field its Struct declares is always its own.
LMCACHE_NEUTRAL_VALUES: dict[str, object] = {
    "affinity_tag": "_default",
    "shared": False,
    "persist_enabled": True,
}


def lmcache_unsupported(config_type: type, kind: Kind = Kind.L2_ADAPTER) -> dict[str, str]:
    """LMCache fields the component whose Struct is ``config_type`` does not take -> why: its
    Struct's ``lmcache_unsupported``, and for an adapter the fields of every adapter object."""
    own: Mapping[str, str] = getattr(config_type, "lmcache_unsupported", {})
    common = LMCACHE_COMMON_UNSUPPORTED if kind is Kind.L2_ADAPTER else {}
    return {**common, **own}


def _lmcache_neutral_values(config_type: type, kind: Kind) -> dict[str, object]:
    """The no-op values of the component's LMCache fields.  A common field the adapter gives
    a reason of its own for (mock's persist_enabled: nothing outlives the process) has no
    no-op value unless the adapter names one too."""
    own_reasons: Mapping[str, str] = getattr(config_type, "lmcache_unsupported", {})
    common = LMCACHE_NEUTRAL_VALUES if kind is Kind.L2_ADAPTER else {}
    kept = {key: value for key, value in common.items() if key not in own_reasons}
    return {**kept, **getattr(config_type, "lmcache_neutral_values", {})}


def _without_neutral_lmcache_fields(
    config_type: type, fields: dict[str, Any], kind: Kind = Kind.L2_ADAPTER
) -> dict[str, Any]:
    """``fields`` without the LMCache fields that hold their no-op value (``affinity_tag:
    "_default"``), or null (LMCache's "not set"): LMCache's configs keep working and mean
    the same here.  Values compare as JSON values: ``0`` is not ``false``."""
    neutral = _lmcache_neutral_values(config_type, kind)
    unsupported = lmcache_unsupported(config_type, kind)
    # A field the adapter declares (fs's persist_enabled) keeps the value given: dropping it
    # would put the adapter's default in its place.
    declared = {field.encode_name for field in msgspec.structs.fields(config_type)}

    def is_neutral(key: str, value: Any) -> bool:
        if key in declared:
            return False
        if value is None:
            return key in unsupported
        return key in neutral and type(value) is type(neutral[key]) and value == neutral[key]

    return {key: value for key, value in fields.items() if not is_neutral(key, value)}


_UNKNOWN_FIELD = re.compile(r"^Object contains unknown field `(?P<field>[^`]*)`$")


def unknown_field_message(message: str, component: str, unsupported: Mapping[str, str]) -> str:
    """msgspec's "unknown field" message saying the field is not supported, and why when it is
    one of LMCache's (``unsupported``); any other message unchanged."""
    found = _UNKNOWN_FIELD.match(message)
    if found is None:
        return message
    field = found.group("field")
    reason = unsupported.get(field)
    if reason is not None:
        return (
            f"unknown field `{field}`: this LMCache field is not supported by {component}: "
            f"{reason}; remove it"
        )
    return (
        f"unknown field `{field}`: not supported by {component} "
        "(`lmcache-tiers plugins reference` lists its fields)"
    )


class AdapterSpec(ComponentConfig):
    """A resolved ``--l2-adapter``: the plugin type and its decoded config."""

    type: str
    config: L2AdapterConfig
    serde: tuple[SerdeSpec, ...] = ()


class FrontendConfig(ComponentConfig, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Options every front end accepts; front-end plugins subclass this Struct."""

    host: Annotated[
        # "" is no address: libzmq refuses to bind it only once the server is built
        Annotated[str, Meta(min_length=1)] | None,
        Meta(description="Address to listen on (or an ipc:// endpoint); null: --host."),
    ] = None
    port: Annotated[
        Annotated[int, Meta(ge=0, le=65535)] | None, Meta(description="Port to listen on; null: --port.")
    ] = None

    def address(self, server: ServerConfig) -> tuple[str, int]:
        """The host and port this front end listens on, the server's where not given."""
        host = self.host if self.host is not None else server.host
        return host, self.port if self.port is not None else server.port

    def endpoint(self, server: ServerConfig) -> str:
        """The endpoint to bind, e.g. ``tcp://127.0.0.1:5555`` (``*`` for port 0)."""
        return rpc_endpoint(*self.address(server))

    def check(self, server: ServerConfig, auth_token: str | None) -> None:
        """Raise ConfigError for a configuration this front end cannot serve; runs before
        L1 exists.  The default checks that the address is one ZeroMQ can bind."""
        self.endpoint(server)

    def check_pool_bound(self, server: ServerConfig, largest: int, options: str) -> None:
        """Raise ConfigError when the server's ``frontend_pool_max_mb`` holds less than
        ``largest``, the bytes of the largest request this front end reads (``options``:
        the options that set it).  Such a request is still read and served, alone: the
        bound would only serve the largest requests one at a time, which a configuration
        never means."""
        if server.frontend_pool_max_mb << 20 < largest:
            raise ConfigError(
                f"frontend_pool_max_mb {server.frontend_pool_max_mb} (MiB, --frontend-pool-max-mb) "
                f"holds less than the largest request this front end takes ({largest} bytes, "
                f"{options}): raise it, or lower {options}"
            )


class FrontendSpec(ComponentConfig, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """A resolved ``--frontend``: the front-end type and its decoded config."""

    type: str
    config: FrontendConfig


#: the largest integer every wire protocol carries (a signed 64-bit msgpack integer)
_MAX_WIRE_INT = (1 << 63) - 1
#: ``frontend_pool_max_mb``'s default: twice the native front end's largest request
#: (``max_request_bytes``, 1 GiB), so that one such request never holds the pool alone
FRONTEND_POOL_MAX_MB = 2048


def _doc(text: str, **constraints: Any) -> Meta:
    return Meta(description=text, **constraints)


class ServerConfig(ComponentConfig):
    """Everything ``lmcache-tiers serve`` runs with; flag names follow LMCache's server."""

    host: Annotated[
        str,
        # "" is no address: libzmq refuses to bind it only once the server is built
        _doc("Address the RPC server binds to; non-loopback needs auth_token.", min_length=1),
    ] = "127.0.0.1"
    port: Annotated[int, _doc("RPC port (ZeroMQ ROUTER).", ge=0, le=65535)] = 5555
    chunk_size: Annotated[int, _doc("Tokens per KV chunk; keys hash full chunks only.", gt=0)] = 256
    l1_size_gb: Annotated[SizeGiB, _doc("Size of the L1 CPU-memory arena in GiB.", gt=0.0)] = 1.0
    l1_align_bytes: Annotated[int, _doc("Alignment of L1 extents in bytes.", ge=64, le=1 << 21)] = 4096
    l1_lock_ttl_s: Annotated[float, _doc("Seconds before an unreleased read lock expires.", gt=0.0)] = 300.0
    l1_write_ttl_s: Annotated[float, _doc("Seconds before an uncommitted write is dropped.", gt=0.0)] = 600.0
    l1_shm_name: Annotated[
        str | None, _doc("Name of the L1 shared-memory segment; null picks a unique one.")
    ] = None
    l1_shm_dir: Annotated[
        str,
        _doc(
            "Directory (on a tmpfs) holding the L1 shared-memory segment. A tmpfs mounted with "
            "huge=always puts the arena on huge pages, so a fresh client's first store runs near "
            "memcpy speed; LMCache clients of the lmcache_mp front end need /dev/shm."
        ),
    ] = "/dev/shm"
    eviction_policy: Annotated[str, _doc("L1 eviction policy (LRU, noop, ...).")] = "LRU"
    eviction_trigger_watermark: Annotated[
        float, _doc("L1 usage fraction at which eviction starts.", gt=0.0, le=1.0)
    ] = 0.8
    eviction_ratio: Annotated[
        float, _doc("Fraction of allocated L1 memory freed per eviction round.", gt=0.0, le=1.0)
    ] = 0.2
    l2_adapters: Annotated[
        tuple[AdapterSpec, ...], _doc("L2 adapters in cascade order (lower index is preferred).")
    ] = ()
    frontends: Annotated[
        tuple[FrontendSpec, ...],
        _doc("Wire protocols served, each on its own address; empty: the native one on host:port."),
    ] = ()
    l2_store_policy: Annotated[str, _doc("Which adapters new L1 objects are stored to.")] = "default"
    l2_prefetch_policy: Annotated[str, _doc("Which adapter each L2 hit is loaded from.")] = "default"
    l2_prefetch_max_in_flight: Annotated[
        # /status and the native STATUS reply carry it as a msgpack integer
        int,
        _doc("Prefetch requests running at once; the rest queue.", ge=1, le=_MAX_WIRE_INT),
    ] = 8
    frontend_pool_max_mb: Annotated[
        int,
        _doc(
            "MiB of request messages each front end holds on its worker pool (running and queued): "
            "at it the front end reads no more requests until its pool is down to three quarters "
            "of it (its requests wait in ZeroMQ's queues). At least the native front end's "
            "max_request_bytes.",
            ge=1,
        ),
    ] = FRONTEND_POOL_MAX_MB
    shutdown_timeout_s: Annotated[
        float,
        _doc(
            "Seconds a stop waits for in-flight requests, then again for pending L2 stores, before "
            "abandoning what is left (counted and logged); a second signal stops at once.",
            ge=0.0,
            # the stop joins threads until this deadline, and a join refuses one beyond the
            # platform's time_t: a day is more than any drain needs
            le=86400.0,
        ),
    ] = 10.0
    metrics_host: Annotated[
        str, _doc("Address the HTTP endpoint (/metrics, /healthz, /status) binds to.", min_length=1)
    ] = "127.0.0.1"
    metrics_port: Annotated[
        int, _doc("HTTP port for /metrics, /healthz, /status; 0 disables.", ge=0, le=65535)
    ] = 9090
    auth_token: Annotated[
        str | None, _doc("Shared secret every request must carry; required off loopback.")
    ] = None
    no_shm: Annotated[bool, _doc("Do not offer the shared-memory data plane; bytes travel inline.")] = False
    gds_l1_path: Annotated[
        str | None,
        _doc(
            "Directory for an NVMe-backed L1 (a file of blocks) instead of CPU memory; null = memory. "
            "That L1 has no shared-memory segment: serve refuses an l1_shm_name or l1_shm_dir given with it."
        ),
    ] = None
    gds_l1_use_direct_io: Annotated[
        bool, _doc("Open the NVMe L1 file with O_DIRECT (bypass the page cache).")
    ] = True

    def __post_init__(self) -> None:
        if self.chunk_size > _MAX_WIRE_INT:
            # Hello replies and get_chunk_size carry it as a msgpack integer: a larger one
            # cannot be encoded, and the first client's handshake would stop the server.
            raise FieldError(
                "chunk_size",
                f"chunk_size {self.chunk_size} does not fit the 64-bit integer the protocols carry "
                f"it in (at most {_MAX_WIRE_INT}); LMCache's default is 256",
            )
        if self.auth_token == "":
            # Read as "no token" (an unset variable expanded on a command line): on loopback
            # the server would start without authentication, unsaid.
            raise FieldError(
                "auth_token",
                "auth_token is empty, which authenticates nothing: give the secret, or leave "
                "auth_token out to serve without one (loopback only)",
            )
        name = self.l1_shm_name
        if name == "":
            raise FieldError(
                "l1_shm_name", "an empty l1_shm_name names no segment; no_shm = true turns shared memory off"
            )
        if name is not None and (not _SEGMENT_NAME.match(name) or name in (".", "..")):
            raise FieldError(
                "l1_shm_name",
                f"shared-memory name {name!r} is not allowed: use 1-200 characters from [A-Za-z0-9._-]",
            )

    @property
    def l1_size_bytes(self) -> int:
        return int(self.l1_size_gb * (1 << 30))


#: the name of a segment file in its directory (the L1 arena creates nothing else there)
_SEGMENT_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}\Z")  # \Z: $ also matches before a final newline


class FieldError(ValueError):
    """Raised by a config Struct's ``__post_init__`` about one of its values, so the error
    names that value's full path.  ``field`` is the path below the Struct, dotted
    (``backend_params.max_capacity_gb``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def check_size_gib(field: str, gib: float) -> None:
    """For a config's ``__post_init__``: a FieldError when ``gib`` is positive but under
    one byte -- as a capacity it would be 0 bytes, which refuses every store (or reads as
    "no limit" where 0 means that)."""
    if gib > 0 and int(gib * (1 << 30)) < 1:
        raise FieldError(field, f"{field} {gib:g} is under one byte; the least is {1 / (1 << 30):g}")


_PATH_STEP = re.compile(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]")


def _path_step(key: object) -> str:
    text = str(key)
    return f".{text}" if re.fullmatch(r"[A-Za-z_][\w-]*", text) else f"[{json.dumps(text)}]"


#: the most levels of lists and tables a config value may nest (real ones nest a few): a
#: field that takes any data (an adapter's ``storage_options``) would otherwise keep a
#: value that exhausts the stack of what walks it later (``--print-config``'s redaction)
MAX_VALUE_DEPTH = 32


def _first_unusable(value: Any, path: str, depth: int = 0) -> tuple[str, str] | None:
    """The path of the first value no config field can take in plain config data, and
    why: an infinity or NaN, a string holding a NUL character, or lists and tables
    nested more than MAX_VALUE_DEPTH levels deep."""
    if isinstance(value, float):
        return None if math.isfinite(value) else (path, f"Expected a finite number, got {value}")
    if isinstance(value, str):
        return _unusable_text(value, path)
    if isinstance(value, Mapping):
        items: Any = ((path + _path_step(key), item) for key, item in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"{path}[{index}]", item) for index, item in enumerate(value))
    else:
        return None
    if depth >= MAX_VALUE_DEPTH:
        return (path, f"Expected lists and tables nested at most {MAX_VALUE_DEPTH} levels deep")
    for where, item in items:
        found = _first_unusable(item, where, depth + 1)
        if found is not None:
            return found
    return None


def _unusable_text(value: str, path: str) -> tuple[str, str] | None:
    """Why no config field can take the string ``value``, or None.  A lone surrogate is
    what JSON's ``\\ud800`` and a non-UTF-8 byte of a flag (read as ``\\udcff``) become:
    it is no text: encoding it as UTF-8 (a token or URL sent on a socket) raises
    UnicodeEncodeError once the server is half built, and a printed config holding it is
    JSON that strict readers refuse.  A file name that is not UTF-8 is refused with it:
    rename the directory."""
    if "\0" in value:
        return (path, "Expected a string without NUL characters")
    surrogate = _LONE_SURROGATE.search(value)
    if surrogate is not None:
        return (path, f"Expected UTF-8 text, got a lone surrogate {ascii(surrogate.group())[1:-1]}")
    return None


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def refuse_unusable_values(raw: Any, where: str, prefix: str = "") -> None:
    """Raise ConfigError naming the first infinite or NaN number, string holding a NUL
    character or a lone surrogate (not UTF-8), or value nested too deeply, in ``raw``
    (rooted at ``where``).  No config
    value is one: JSON has neither number (what ``json`` reads as ``1e400`` or
    ``Infinity`` and TOML's ``inf`` and ``nan`` are refused), sizes and durations must
    convert to bytes and timeouts, and a printed config stays JSON; JSON's and TOML's
    ``\\u0000`` ends every path, URL and name at the system call or C library it reaches
    (Python refuses such a path with ValueError, which would stop start-up with a
    traceback rather than this line)."""
    found = _first_unusable(raw, where)
    if found is not None:
        path, reason = found
        raise ConfigError(f"{prefix}{reason} - at `{path}`")


def _declared_child(declared: Any, step: str | int) -> Any:
    """The declared type one step (field name, list index or map value) below ``declared``."""
    while True:
        origin = typing.get_origin(declared)
        if origin is Annotated:
            declared = typing.get_args(declared)[0]
        elif origin is typing.Union or type(declared).__name__ == "UnionType":
            options = [a for a in typing.get_args(declared) if a is not type(None)]
            declared = options[0] if len(options) == 1 else Any
        else:
            break
    if isinstance(declared, type) and issubclass(declared, msgspec.Struct) and isinstance(step, str):
        for info in msgspec.structs.fields(declared):
            if info.encode_name == step:
                return info.type
        return Any
    args = typing.get_args(declared)
    if origin in (dict, Mapping) and len(args) == 2:
        return args[1]
    if origin in (list, tuple, set, frozenset) and args:
        return args[0]
    return Any


def _locate(declared: Any, raw: Any, msgspec_path: str) -> tuple[str, Any]:
    """msgspec's path below ``$`` with every ``[...]`` (a map value) replaced by the key
    whose value fails, and the raw value found there (None when it cannot be followed)."""
    concrete, value = "", raw
    for name, index in _PATH_STEP.findall(msgspec_path):
        if name:
            concrete += f".{name}"
            declared = _declared_child(declared, name)
            value = value.get(name) if isinstance(value, Mapping) else None
        elif index == "...":
            declared = _declared_child(declared, "...")
            bad = None
            for key, item in value.items() if isinstance(value, Mapping) else ():
                try:
                    msgspec.convert(item, declared)
                except (msgspec.ValidationError, TypeError):
                    bad = (key, item)
                    break
            if bad is None:
                return concrete + msgspec_path[msgspec_path.index("[...]") :], None
            concrete += _path_step(bad[0])
            value = bad[1]
        else:
            concrete += f"[{index}]"
            declared = _declared_child(declared, int(index))
            value = value[int(index)] if isinstance(value, list) and int(index) < len(value) else None
    return concrete, value


def _quoting_hint(message: str, value: Any) -> str:
    """How to write a value that has the right content but the wrong JSON/TOML type."""
    if message.startswith("Expected `str`, got `") and isinstance(value, (bool, int, float)):
        return f" (write it as a string: {json.dumps(json.dumps(value))})"
    if isinstance(value, str):
        literal = value.strip().lower()
        if message.startswith(("Expected `float`, got `str`", "Expected `int`, got `str`")):
            try:
                number = float(literal)
            except ValueError:
                return ""
            if message.startswith("Expected `float`"):
                shown = literal
            else:
                shown = str(int(number)) if number.is_integer() else ""
            return f" (write the number without quotes: {shown})" if shown else ""
        if message.startswith("Expected `bool`, got `str`") and literal in ("true", "false"):
            return f" (write {literal} without quotes)"
    return ""


def validation_message(exc: msgspec.ValidationError, where: str, declared: Any, raw: Any) -> str:
    """msgspec's error about ``raw`` (decoded as ``declared``) with the path rooted at
    ``where`` and naming every map key, e.g. ``... - at `$.l2_adapters[0].backend_params.x```."""
    text = str(exc)
    message, _, at = text.partition(" - at `")
    cause = exc.__cause__
    if isinstance(cause, FieldError):
        message = str(cause)
    below, value = _locate(declared, raw, at.rstrip("`")[1:] if at else "")
    if isinstance(cause, FieldError):
        below += "." + cause.field
        value = None
    return f"{message}{_quoting_hint(message, value)} - at `{where}{below}`"


#: fields of an adapter spec that hold specs of other components
_NESTED_SPECS = ("serde", "inner")


def decode_component(
    registry: ComponentRegistry, kind: Kind, raw: Mapping[str, Any], where: str
) -> tuple[str, msgspec.Struct]:
    """Decode ``{"type": name, ...}`` into the registered component's config Struct."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    if "type" not in raw:
        raise ConfigError(f"{where}: missing required field `type`")
    if not isinstance(raw["type"], str):
        # Read as text, null would be refused as an unknown component named 'None'.
        value = raw["type"]
        shown = (
            json.dumps(value) if value is None or isinstance(value, (int, float)) else type(value).__name__
        )
        raise ConfigError(
            f"`type` must be a string naming an installed {kind.value.replace('_', ' ')}, got {shown} "
            f"(`lmcache-tiers plugins list`) - at `{where}.type`"
        )
    try:
        component = registry.get(kind, str(raw["type"]))
    except ConfigError as exc:
        raise ConfigError(f"{exc} - at `{where}.type`") from None
    fields = {k: v for k, v in raw.items() if k != "type"}
    # An adapter's serde chain and a wrapper's inner spec are decoded on their own, and
    # checked there under their own component's name.
    nested = _NESTED_SPECS if kind is Kind.L2_ADAPTER else ()
    # (A nested field holding no list or table is no spec: it is checked here.)
    own = {k: v for k, v in fields.items() if k not in nested or not isinstance(v, (list, Mapping))}
    refuse_unusable_values(own, where, f"{component.name}: ")
    # LMCache's fields of an adapter object, or of a serde's (fp8's max_workers)
    fields = _without_neutral_lmcache_fields(component.config, fields, kind)
    unsupported = lmcache_unsupported(component.config, kind)
    try:
        config = msgspec.convert(fields, component.config)
    except msgspec.ValidationError as exc:
        text, _, at = validation_message(exc, where, component.config, fields).partition(" - at `")
        # Only a field of the adapter's own object (not of its eviction, ...) is one of LMCache's.
        known = unsupported if at == f"{where}`" else {}
        message = f"{unknown_field_message(text, component.name, known)} - at `{at}"
        raise ConfigError(f"{component.name}: {message}") from exc
    except FieldError as exc:  # raised from a Struct's __post_init__ outside msgspec
        raise ConfigError(f"{component.name}: {exc} - at `{where}.{exc.field}`") from exc
    except (TypeError, ValueError) as exc:  # raised from a Struct's __post_init__
        raise ConfigError(f"{component.name}: {exc} - at `{where}`") from exc
    return component.name, config


def _require_component(registry: ComponentRegistry, kind: Kind, name: str, where: str) -> None:
    """An installed component named by the config at ``where``: its unknown-name error
    names the path too (and ``serve`` the flag that set it), as every config error does."""
    try:
        registry.get(kind, name)
    except ConfigError as exc:
        raise ConfigError(f"{exc} - at `{where}`") from None


def decode_adapter(registry: ComponentRegistry, raw: Any, index: int) -> AdapterSpec:
    """Resolve one adapter spec (already parsed from JSON or TOML)."""
    return decode_adapter_at(registry, raw, f"$.l2_adapters[{index}]")


def decode_adapter_at(registry: ComponentRegistry, raw: Any, where: str, wrappers: int = 0) -> AdapterSpec:
    """Resolve the adapter spec found at config path ``where`` (``$.l2_adapters[0]``, or
    ``$.l2_adapters[0].inner`` for the adapter a wrapper wraps; ``wrappers``: how many
    wrap it)."""
    if wrappers > MAX_VALUE_DEPTH:
        # An inner spec is checked on its own, outside the value-depth check: a chain of
        # wrappers would otherwise recurse past the stack here, in --print-config's
        # redaction or when the wrappers are built.
        top = where.split(".inner", 1)[0]
        raise ConfigError(f"adapter wrappers nested more than {MAX_VALUE_DEPTH} deep - at `{top}`")
    if isinstance(raw, Mapping) and isinstance(raw.get("serde"), Mapping):
        # LMCache writes one serde as an object; a chain of one is the same thing.
        raw = {**raw, "serde": [raw["serde"]]}
    name, config = decode_component(registry, Kind.L2_ADAPTER, raw, where)
    if not isinstance(config, L2AdapterConfig):
        raise ConfigError(f"{name}: its config Struct does not subclass L2AdapterConfig")
    if config.eviction is not None:
        _require_component(
            registry,
            Kind.EVICTION_POLICY,
            config.eviction.eviction_policy,
            f"{where}.eviction.eviction_policy",
        )
    serdes = tuple(
        SerdeSpec(type=s_name, config=s_config)
        for s_name, s_config in (
            decode_component(registry, Kind.SERDE, item, f"{where}.serde[{i}]")
            for i, item in enumerate(config.serde)
        )
    )
    inner = getattr(config, "inner", None)
    if isinstance(inner, Mapping):
        # A wrapper (fault_inject) builds the adapter it wraps from this spec when it starts:
        # its mistakes are found now, before anything is built, and named by their own path.
        decode_adapter_at(registry, inner, f"{where}.inner", wrappers + 1)
    # Keep the expanded serde specs (defaults filled in) so a printed config reads back equal.
    expanded = tuple({"type": s.type, **msgspec.to_builtins(s.config)} for s in serdes)
    config = msgspec.structs.replace(config, serde=expanded)
    return AdapterSpec(type=name, config=config, serde=serdes)


def parse_adapter_json(registry: ComponentRegistry, text: str, index: int) -> AdapterSpec:
    """Parse the JSON of one ``--l2-adapter`` flag."""
    return decode_adapter(registry, _json_flag("--l2-adapter", index, text), index)


#: the front end that runs when none is configured
DEFAULT_FRONTEND = "native"


def decode_frontend(registry: ComponentRegistry, raw: Any, index: int) -> FrontendSpec:
    """Resolve one front-end spec (already parsed from JSON or TOML)."""
    name, config = decode_component(registry, Kind.FRONTEND, raw, f"$.frontends[{index}]")
    if not isinstance(config, FrontendConfig):
        raise ConfigError(f"{name}: its config Struct does not subclass FrontendConfig")
    return FrontendSpec(type=name, config=config)


def default_frontends(registry: ComponentRegistry) -> tuple[FrontendSpec, ...]:
    """The native front end on ``host``:``port``, when no front end is configured (none when
    its plugin is not installed: the server then refuses to start, an in-process replay
    needs no front end)."""
    if DEFAULT_FRONTEND not in registry.names(Kind.FRONTEND):
        return ()
    return (decode_frontend(registry, {"type": DEFAULT_FRONTEND}, 0),)


def _json_flag(flag: str, index: int, text: str) -> Any:
    """The value of the ``index``-th (from 0) repeat of a JSON flag."""
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{flag} #{index + 1} is not valid JSON: {exc.msg} at column {exc.colno}") from exc
    except _DuplicateKey as exc:
        raise ConfigError(
            f"{flag} #{index + 1} is not valid config JSON: key `{exc}` is given twice in one object; "
            "keep one"
        ) from None
    except RecursionError:  # the parser recurses once per nested array or object
        raise ConfigError(f"{flag} #{index + 1} is not valid config JSON: it is nested too deeply") from None


class _DuplicateKey(ValueError):
    """A JSON object writes one key twice (the message is the key)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object as a dict, refusing a key written twice: ``json`` keeps the last, so
    the first value would be dropped without a word (a TOML file refuses it the same way)."""
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


#: the largest ``--config`` file read (a real one is a few KiB): a runaway generator behind
#: a pipe must end in an error, not in reading for ever
MAX_CONFIG_BYTES = 1 << 20
#: how long a pipe given as ``--config`` (``<(generate-config)``) may take to deliver its
#: whole content: a writer that holds it open without ending would hold start-up for ever
CONFIG_PIPE_WAIT_S = 10.0

#: what the kinds of file a config cannot be are called in its refusal
_NOT_A_FILE = {
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def load_toml(path: str) -> dict[str, Any]:
    """Read a ``--config`` TOML file into a plain dict."""
    try:
        content = _config_bytes(path)
        if len(content) > MAX_CONFIG_BYTES:
            raise ConfigError(
                f"config file {path!r} is larger than {MAX_CONFIG_BYTES >> 20} MiB; it is not a config file"
            )
        return tomllib.loads(content.decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path!r} is a directory; give the path of a TOML file") from None
    except PermissionError:
        raise ConfigError(f"config file {path!r} cannot be read: this user may not read it") from None
    except OSError as exc:
        raise ConfigError(f"config file {path!r} cannot be read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {path!r} is not valid TOML: it is not UTF-8 text (byte {exc.start + 1})"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path!r} is not valid TOML: {exc}") from None
    except RecursionError:
        # tomllib recurses once per nested array or table: a small file can exhaust the stack
        raise ConfigError(
            f"config file {path!r} is not valid TOML: its values are nested too deeply"
        ) from None


def _config_bytes(path: str) -> bytes:
    """Up to ``MAX_CONFIG_BYTES + 1`` bytes of a regular file or a pipe.  Anything else is
    refused before it is opened: opening a device may act on it (a tape rewinds, a
    terminal waits for typing), and /dev/null would read as an empty config."""
    kind = stat.S_IFMT(os.stat(path).st_mode)
    if kind == stat.S_IFDIR:
        raise IsADirectoryError(path)
    if kind not in (stat.S_IFREG, stat.S_IFIFO):
        what = _NOT_A_FILE.get(kind, "not a regular file")
        raise ConfigError(f"config file {path!r} is {what}, not a file; give the path of a TOML file")
    # Not blocking: a FIFO nobody has open for writing would block the open itself for ever.
    with open(path, "rb", buffering=0, opener=_open_without_waiting) as handle:
        fd = handle.fileno()
        opened = stat.S_IFMT(os.fstat(fd).st_mode)
        if opened == stat.S_IFREG:
            os.set_blocking(fd, True)
            return _read_up_to(fd, MAX_CONFIG_BYTES + 1)
        if opened == stat.S_IFIFO:
            return _pipe_bytes(path, fd)
    # replaced by something else between the two looks
    raise ConfigError(f"config file {path!r} changed while it was opened; give the path of a TOML file")


def _open_without_waiting(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NONBLOCK | os.O_NOCTTY)


def _read_up_to(fd: int, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while size < limit:
        chunk = os.read(fd, limit - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _pipe_bytes(path: str, fd: int) -> bytes:
    """A pipe's content up to its end (its writer closing it), within CONFIG_PIPE_WAIT_S."""
    deadline = time.monotonic() + CONFIG_PIPE_WAIT_S
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    chunks: list[bytes] = []
    size = 0
    while size <= MAX_CONFIG_BYTES:
        try:
            chunk = os.read(fd, MAX_CONFIG_BYTES + 1 - size)
        except BlockingIOError:  # a writer has it open and has not written yet
            left = deadline - time.monotonic()
            if left <= 0:
                raise ConfigError(
                    f"config file {path!r} is a pipe its writer did not finish within "
                    f"{CONFIG_PIPE_WAIT_S:g} s; serve reads --config once, at start"
                ) from None
            poller.poll(max(1, math.ceil(left * 1000)))
            continue
        if not chunk:  # no writer has it open (any more)
            break
        chunks.append(chunk)
        size += len(chunk)
    if not chunks:
        # Linux reads the end at once from a FIFO no process has open for writing: waiting
        # would be for a writer that may never come.
        raise ConfigError(
            f"config file {path!r} is a FIFO or pipe with nothing written to it and no writer; "
            "give the path of a TOML file, or start what writes it first"
        )
    return b"".join(chunks)


def file_fields(file_values: Mapping[str, Any]) -> dict[str, Any]:
    """A config file's top-level keys as ServerConfig field names (``l2-adapters`` is
    ``l2_adapters``); ConfigError for an unknown key or one written both ways."""
    fields: dict[str, Any] = {}
    written: dict[str, str] = {}
    for key, value in file_values.items():
        norm = key.replace("-", "_")
        if norm not in ServerConfig.__struct_fields__:
            raise ConfigError(f"unknown config field `$.{key}`")
        if norm in fields:
            raise ConfigError(f"config field `$.{norm}` is given twice (as `{written[norm]}` and `{key}`)")
        fields[norm] = value
        written[norm] = key
    return fields


def build_config(
    registry: ComponentRegistry,
    file_values: Mapping[str, Any] | None = None,
    overrides: Mapping[str, Any] | None = None,
    adapter_json: list[str] | None = None,
    frontend_json: list[str] | None = None,
) -> ServerConfig:
    """Merge defaults < config file < command-line flags and validate everything.

    ``adapter_json`` (the repeated ``--l2-adapter`` flags) replaces the file's
    ``l2_adapters`` list when given, since adapter order is the cascade order;
    ``frontend_json`` (``--frontend``) replaces its ``frontends`` the same way.  With no
    front end anywhere, the native one serves on ``host``:``port``.
    """
    values: dict[str, Any] = {}
    raw_lists: dict[str, list[Any]] = {"l2_adapters": [], "frontends": []}
    for key, value in file_fields(file_values or {}).items():
        if key in raw_lists:
            if not isinstance(value, list):
                raise ConfigError(f"expected a list of tables (`[[{key}]]`) - at `$.{key}`")
            raw_lists[key] = list(value)
        else:
            values[key] = value
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    refuse_unusable_values(values, "$")
    try:
        config = msgspec.convert(values, ServerConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(validation_message(exc, "$", ServerConfig, values)) from exc

    if adapter_json:
        adapters = tuple(parse_adapter_json(registry, text, i) for i, text in enumerate(adapter_json))
    else:
        adapters = tuple(decode_adapter(registry, raw, i) for i, raw in enumerate(raw_lists["l2_adapters"]))
    raw_frontends = (
        [_json_flag("--frontend", i, text) for i, text in enumerate(frontend_json)]
        if frontend_json
        else raw_lists["frontends"]
    )
    frontends = tuple(decode_frontend(registry, raw, i) for i, raw in enumerate(raw_frontends))
    _require_component(registry, Kind.EVICTION_POLICY, config.eviction_policy, "$.eviction_policy")
    _require_component(registry, Kind.STORE_POLICY, config.l2_store_policy, "$.l2_store_policy")
    _require_component(registry, Kind.PREFETCH_POLICY, config.l2_prefetch_policy, "$.l2_prefetch_policy")
    return msgspec.structs.replace(
        config, l2_adapters=adapters, frontends=frontends or default_frontends(registry)
    )


def config_to_builtins(config: ServerConfig) -> dict[str, Any]:
    """The resolved config as plain data, with each adapter's and front end's ``type`` put back."""
    data: dict[str, Any] = msgspec.to_builtins(config)
    for name, specs in (("l2_adapters", config.l2_adapters), ("frontends", config.frontends)):
        data[name] = [{"type": spec.type, **msgspec.to_builtins(spec.config)} for spec in specs]
    return data


#: field names whose values are credentials: never printed nor logged.  Azure's account
#: key and connection string (which holds the account key or a shared access signature)
#: are named so by the NIXL AZURE_BLOB backend and fsspec's ``abfs://`` store; a private
#: key's ``passphrase`` by fsspec's ``sftp://`` store; an HTTP store's ``headers``
#: (``Authorization``, ``Proxy-Authorization``, ``Cookie``) and its client's ``auth`` pair
#: by fsspec's ``http(s)://`` store (``auth`` only as a whole name or its last word: an
#: ``author`` is no credential).
SECRET_FIELD = re.compile(
    r"secret|password|passwd|passphrase|token|credential|access_key|api_key"
    r"|account_?key|connection_?string|private_?key|shared_?access"
    r"|authorization|cookie|(?:^|[_-])auth$",
    re.IGNORECASE,
)
#: where a URL's authority (``redis://user:password@host:port``) ends at the latest: its
#: first ``/`` or blank.  It also ends where the next URL's scheme begins (``h1:1,redis://...``
#: in a list of nodes), and a ``?`` or ``#`` written unescaped in a password is hidden with
#: it (URL parsers end the authority there too, but a refusal may still quote the whole URL)
_AUTHORITY_END = re.compile(r"[/\s]")
_BLANK = re.compile(r"\s")
_WORD = re.compile(r"\S+")
#: what follows the ``@`` ending a password that holds blanks: a host (and port), then the
#: end of the word, a path, a query, the next node of a list, a ``;`` ending the clause or
#: the mark closing the one written just before the URL (``'redis://u:a b@host'``).  A
#: later ``@`` before anything else (``'user@node'``, ``x@y)``) is no password's end, while
#: a passphrase of several words is still hidden whole.
_HOST_AFTER_SIGN = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(?::\d*)?")
_AFTER_HOST = frozenset("/,?#;")
_CLOSING_MARK = {"'": "'", '"': '"', "`": "`", "(": ")", "[": "]", "{": "}", "<": ">"}
_SCHEME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+.-")
#: a query parameter of a URL named like a credential (``redis://host/0?password=...``,
#: which redis-py reads as the password).  A name runs from a ``&``, or from the first ``?``
#: of a run of characters between ``=``, ``&``, ``#`` and blanks, to the ``=`` ending that
#: run, so one holding ``?`` (``?password?=``) is hidden too.  The match starts only there
#: (a run's later ``?`` starts none): each run is scanned a bounded number of times, where
#: starting at every ``?`` scanned a long text to its end from each (quadratic time).
_URL_QUERY_SECRET = re.compile(
    rf"(?P<head>(?:&|(?<![^=&#\s])[^=&#?\s]*\?)(?=[^=&#\s]*?(?:{SECRET_FIELD.pattern}))[^=&#\s]*=)[^&#\s]*",
    re.IGNORECASE,
)
#: the credential of an Azure connection string quoted in a text (an error line quoting
#: the config value): ``AccountKey=...;``, ``SharedAccessSignature=...;``.  Its value
#: runs to the ``;`` ending it, a blank or a quote.
_CONNECTION_STRING_SECRET = re.compile(
    r"(?P<head>(?<![A-Za-z0-9_])(?:AccountKey|SharedAccessKey|SharedAccessSignature)=)[^;\s'\"`]*",
    re.IGNORECASE,
)
#: the signature of an Azure shared access signature URL (``account_url`` with a SAS:
#: ``https://acct.blob.core.windows.net/?sv=...&sig=...``): it grants the access itself.
_SAS_SIGNATURE = re.compile(r"(?P<head>[?&]sig=)[^&#;\s'\"`]*", re.IGNORECASE)
REDACTED = "***"


def redact_url_secrets(text: str) -> str:
    """``text`` with the passwords of the URLs in it -- in their user information or in
    query parameters named like credentials -- and the keys of Azure connection strings
    and SAS URLs replaced by ``***``.  Linear in the length of ``text``: it is applied to error lines
    that quote whatever the user gave."""
    shown = _URL_QUERY_SECRET.sub(rf"\g<head>{REDACTED}", _hide_url_passwords(text))
    shown = _CONNECTION_STRING_SECRET.sub(rf"\g<head>{REDACTED}", shown)
    return _SAS_SIGNATURE.sub(rf"\g<head>{REDACTED}", shown)


def _hide_url_passwords(text: str) -> str:
    """``text`` with the password of every URL's user information hidden.  As URL parsers
    (and redis-py) read it, the user information ends at the *last* ``@`` of the authority
    and the user name at its first ``:``, so a password holding ``@`` or ``:`` is hidden
    whole.  Any ``://`` starts a URL (hiding too much is harmless); each character is looked
    at a bounded number of times, unlike a regular expression looking ahead for the next
    URL at every character (quadratic time)."""
    parts: list[str] = []
    done = 0  # text[:done] is in parts
    separator = text.find("://")
    while separator != -1:
        start = separator + 3
        stop = _AUTHORITY_END.search(text, start)
        end = stop.start() if stop is not None else len(text)
        following = text.find("://", start)
        if following != -1 and following < end:
            # The next URL begins inside: the authority ends where its scheme begins (its
            # first letter in the run of scheme characters before that ``://``).
            first = _scheme_run_start(text, following, start)
            while first < following and not text[first].isalpha():
                first += 1
            if first < following:
                end = first
        userinfo, at, host = text[start:end].rpartition("@")
        if not at and _password_cut_short(host):  # (no "@": rpartition left it all in host)
            limit = _line_end(text, end, following if following != -1 else len(text))
            sign = _user_information_end(text, end, limit, _closing_mark(text, separator))
            if sign is not None:
                stop = _AUTHORITY_END.search(text, sign + 1, limit)
                end = stop.start() if stop is not None else limit
                userinfo, at, host = text[start:sign], "@", text[sign + 1 : end]
        if at and ":" in userinfo:
            user = userinfo.partition(":")[0]
            parts.append(text[done:start])
            parts.append(f"{user}:{REDACTED}@{host}")
            done = end
        separator = following
    parts.append(text[done:])
    return "".join(parts)


def _password_cut_short(authority: str) -> bool:
    """Whether an authority without ``@`` reads as ``user:password`` cut short by a ``/``
    or blank in the password (a generated password often holds ``/``): what follows its
    first ``:`` is no port (digits, or nothing) and it is no IPv6 address (``[::1]``)."""
    _user, colon, rest = authority.partition(":")
    return bool(colon) and bool(rest) and not rest.isdigit() and "[" not in authority


def _line_end(text: str, start: int, limit: int) -> int:
    """Where the line holding ``start`` ends, at the latest at ``limit``: a password holds no
    line break, so a later line's ``@`` (an address in a log) ends none."""
    newline = text.find("\n", start, limit)
    return newline if newline != -1 else limit


def _closing_mark(text: str, separator: int) -> str | None:
    """The mark closing the quote or bracket written just before the scheme of the URL
    whose ``://`` is at ``separator`` (``'`` for ``'redis://...'``), None if there is none.
    Scans back over the scheme alone: each character is looked at a bounded number of times."""
    first = _scheme_run_start(text, separator, 0)
    return _CLOSING_MARK.get(text[first - 1]) if first > 0 else None


def _scheme_run_start(text: str, separator: int, floor: int) -> int:
    """Where the run of scheme characters ending at ``separator`` (a ``://``) begins, not
    before ``floor``."""
    first = separator
    while first > floor and text[first - 1] in _SCHEME_CHARS:
        first -= 1
    return first


def _user_information_end(text: str, end: int, limit: int, closing: str | None) -> int | None:
    """Where the ``@`` ending a user information cut short at ``end`` lies: the last one
    in the run of non-blanks from ``end`` (a password holding ``/`` and ``@``), else the
    last in the first later run where a host follows it (a password holding blanks); None
    if there is none before ``limit`` (the next URL or the line's end).  Requiring the host
    keeps an ``@`` later in the line (a quoted ``user@node``) from hiding the words up to
    it; the mark ``closing`` the URL's quote may follow the host.  Each character is looked
    at at most twice: the search stays within ``[end, limit)``."""
    blank = _BLANK.search(text, end, limit)
    run_end = blank.start() if blank is not None else limit
    sign = text.rfind("@", end, run_end)
    if sign != -1 or blank is None:
        return sign if sign != -1 else None
    for word in _WORD.finditer(text, run_end, limit):
        sign = text.rfind("@", word.start(), word.end())
        if sign != -1 and _host_follows(text, sign + 1, word.end(), closing):
            return sign
    return None


def _host_follows(text: str, start: int, word_end: int, closing: str | None) -> bool:
    """Whether ``text[start:word_end]`` begins with a host (and port) that the word's end,
    a path, a query, a list's next node, a ``;`` or the ``closing`` mark follows."""
    host = _HOST_AFTER_SIGN.match(text, start, word_end)
    if host is None or host.end() == word_end:
        return host is not None
    after = text[host.end()]
    return after in _AFTER_HOST or after == closing


def redact_secrets(value: Any) -> Any:
    """A copy of plain config data (``config_to_builtins``) fit to print: values of
    fields named like credentials and passwords inside URLs become ``***``."""
    if isinstance(value, Mapping):
        return {
            key: REDACTED
            if isinstance(key, str) and SECRET_FIELD.search(key) and item not in (None, "")
            else redact_secrets(item)
            for key, item in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [redact_secrets(item) for item in value]
    if isinstance(value, str):
        return redact_url_secrets(value)
    return value
