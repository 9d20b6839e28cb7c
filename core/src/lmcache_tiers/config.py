"""Configuration: msgspec Structs for the server, L1, eviction and L2 adapter specs.

An adapter spec is JSON with a ``type`` that selects the plugin's own Struct, so the set of
valid adapter configurations is the union of what is installed.  Decoding is two-step
(read ``type``, then decode the rest into that plugin's Struct) so an unknown type can get
a "did you mean" answer and every other mistake keeps msgspec's path.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
from msgspec import Meta

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


class L2EvictionConfig(ComponentConfig):
    """Per-adapter L2 eviction: evict when usage reaches the watermark."""

    eviction_policy: Annotated[str, Meta(description="Eviction policy name, e.g. LRU.")] = "LRU"
    trigger_watermark: Annotated[
        float, Meta(gt=0.0, le=1.0, description="Usage fraction at which eviction starts.")
    ] = 0.8
    eviction_ratio: Annotated[
        float, Meta(gt=0.0, le=1.0, description="Fraction of used bytes freed per eviction round.")
    ] = 0.2


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
        Meta(description='Serde chain applied on the way to L2, e.g. [{"type": "zstd"}].'),
    ] = ()


class AdapterSpec(ComponentConfig):
    """A resolved ``--l2-adapter``: the plugin type and its decoded config."""

    type: str
    config: L2AdapterConfig
    serde: tuple[SerdeSpec, ...] = ()


def _doc(text: str, **constraints: Any) -> Meta:
    return Meta(description=text, **constraints)


class ServerConfig(ComponentConfig):
    """Everything ``lmcache-tiers serve`` runs with; flag names follow LMCache's server."""

    host: Annotated[str, _doc("Address the RPC server binds to; non-loopback needs auth_token.")] = (
        "127.0.0.1"
    )
    port: Annotated[int, _doc("RPC port (ZeroMQ ROUTER).", ge=0, le=65535)] = 5555
    chunk_size: Annotated[int, _doc("Tokens per KV chunk; keys hash full chunks only.", gt=0)] = 256
    l1_size_gb: Annotated[float, _doc("Size of the L1 CPU-memory arena in GiB.", gt=0.0)] = 1.0
    l1_align_bytes: Annotated[int, _doc("Alignment of L1 extents in bytes.", ge=64, le=1 << 21)] = 4096
    l1_lock_ttl_s: Annotated[float, _doc("Seconds before an unreleased read lock expires.", gt=0.0)] = 300.0
    l1_write_ttl_s: Annotated[float, _doc("Seconds before an uncommitted write is dropped.", gt=0.0)] = 600.0
    l1_shm_name: Annotated[
        str | None, _doc("Name of the L1 shared-memory segment; null picks a unique one.")
    ] = None
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
    l2_store_policy: Annotated[str, _doc("Which adapters new L1 objects are stored to.")] = "default"
    l2_prefetch_policy: Annotated[str, _doc("Which adapter each L2 hit is loaded from.")] = "default"
    l2_prefetch_max_in_flight: Annotated[
        int, _doc("Prefetch requests running at once; the rest queue.", ge=1)
    ] = 8
    metrics_port: Annotated[
        int, _doc("HTTP port for /metrics, /healthz, /status; 0 disables.", ge=0, le=65535)
    ] = 9090
    auth_token: Annotated[
        str | None, _doc("Shared secret every request must carry; required off loopback.")
    ] = None
    no_shm: Annotated[bool, _doc("Do not offer the shared-memory data plane; bytes travel inline.")] = False
    gds_l1_path: Annotated[
        str | None,
        _doc("Directory for an NVMe-backed L1 (a file of blocks) instead of CPU memory; null = memory."),
    ] = None
    gds_l1_use_direct_io: Annotated[
        bool, _doc("Open the NVMe L1 file with O_DIRECT (bypass the page cache).")
    ] = True

    @property
    def l1_size_bytes(self) -> int:
        return int(self.l1_size_gb * (1 << 30))


# Fields a user may set; AdapterSpec and serde specs go through their own decoding.
_SCALAR_FIELDS = frozenset(ServerConfig.__struct_fields__) - {"l2_adapters"}


def _validation_message(exc: msgspec.ValidationError, prefix: str) -> str:
    """Rewrite msgspec's ``at `$.x``` path so it is rooted at ``prefix``."""
    text = str(exc)
    return text.replace("`$", f"`{prefix}") if "`$" in text else f"{text} (at `{prefix}`)"


def decode_component(
    registry: ComponentRegistry, kind: Kind, raw: Mapping[str, Any], where: str
) -> tuple[str, msgspec.Struct]:
    """Decode ``{"type": name, ...}`` into the registered component's config Struct."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    if "type" not in raw:
        raise ConfigError(f"{where}: missing required field `type`")
    component = registry.get(kind, str(raw["type"]))
    fields = {k: v for k, v in raw.items() if k != "type"}
    try:
        config = msgspec.convert(fields, component.config, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{component.name}: {_validation_message(exc, where)}") from exc
    except (TypeError, ValueError) as exc:  # raised from a Struct's __post_init__
        raise ConfigError(f"{component.name}: {exc} (at `{where}`)") from exc
    return component.name, config


def decode_adapter(registry: ComponentRegistry, raw: Any, index: int) -> AdapterSpec:
    """Resolve one adapter spec (already parsed from JSON or TOML)."""
    where = f"$.l2_adapters[{index}]"
    name, config = decode_component(registry, Kind.L2_ADAPTER, raw, where)
    if not isinstance(config, L2AdapterConfig):
        raise ConfigError(f"{name}: its config Struct does not subclass L2AdapterConfig")
    if config.eviction is not None:
        registry.get(Kind.EVICTION_POLICY, config.eviction.eviction_policy)
    serdes = tuple(
        SerdeSpec(type=s_name, config=s_config)
        for s_name, s_config in (
            decode_component(registry, Kind.SERDE, item, f"{where}.serde[{i}]")
            for i, item in enumerate(config.serde)
        )
    )
    # Keep the expanded serde specs (defaults filled in) so a printed config reads back equal.
    expanded = tuple({"type": s.type, **msgspec.to_builtins(s.config)} for s in serdes)
    config = msgspec.structs.replace(config, serde=expanded)
    return AdapterSpec(type=name, config=config, serde=serdes)


def parse_adapter_json(registry: ComponentRegistry, text: str, index: int) -> AdapterSpec:
    """Parse the JSON of one ``--l2-adapter`` flag."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"--l2-adapter #{index + 1} is not valid JSON: {exc.msg} at column {exc.colno}"
        ) from exc
    return decode_adapter(registry, raw, index)


def load_toml(path: str) -> dict[str, Any]:
    """Read a ``--config`` TOML file into a plain dict."""
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {path!r} does not exist") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path!r} is not valid TOML: {exc}") from exc


def build_config(
    registry: ComponentRegistry,
    file_values: Mapping[str, Any] | None = None,
    overrides: Mapping[str, Any] | None = None,
    adapter_json: list[str] | None = None,
) -> ServerConfig:
    """Merge defaults < config file < command-line flags and validate everything.

    ``adapter_json`` (the repeated ``--l2-adapter`` flags) replaces the file's
    ``l2_adapters`` list when given, since adapter order is the cascade order.
    """
    values: dict[str, Any] = {}
    raw_adapters: list[Any] = []
    for key, value in (file_values or {}).items():
        norm = key.replace("-", "_")
        if norm == "l2_adapters":
            if not isinstance(value, list):
                raise ConfigError("`$.l2_adapters` must be a list of adapter tables")
            raw_adapters = list(value)
        elif norm in _SCALAR_FIELDS:
            values[norm] = value
        else:
            raise ConfigError(f"unknown config field `$.{key}`")
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        config = msgspec.convert(values, ServerConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(_validation_message(exc, "$")) from exc

    if adapter_json:
        adapters = tuple(parse_adapter_json(registry, text, i) for i, text in enumerate(adapter_json))
    else:
        adapters = tuple(decode_adapter(registry, raw, i) for i, raw in enumerate(raw_adapters))
    registry.get(Kind.EVICTION_POLICY, config.eviction_policy)
    registry.get(Kind.STORE_POLICY, config.l2_store_policy)
    registry.get(Kind.PREFETCH_POLICY, config.l2_prefetch_policy)
    return msgspec.structs.replace(config, l2_adapters=adapters)


def config_to_builtins(config: ServerConfig) -> dict[str, Any]:
    """The resolved config as plain data, with each adapter's ``type`` put back."""
    data: dict[str, Any] = msgspec.to_builtins(config)
    data["l2_adapters"] = [
        {
            "type": spec.type,
            **msgspec.to_builtins(spec.config),
        }
        for spec in config.l2_adapters
    ]
    return data
