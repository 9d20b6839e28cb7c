"""``lmcache-tiers serve``: LMCache's server flags, plus --config, --print-config, --strict."""

from __future__ import annotations

import json
import os
from typing import Annotated, Any, Optional

import typer

from lmcache_tiers.cli.output import fail
from lmcache_tiers.config import ServerConfig, build_config, config_to_builtins, load_toml
from lmcache_tiers.defaults import default_l2_adapters
from lmcache_tiers.endpoints import is_loopback
from lmcache_tiers.plugins import load_plugins

SERVE_HELP = """Run the KV-cache server.

With no flags it serves on the embedded default: a 1 GiB L1 arena, LRU eviction, and a
capacity-capped file L2 under the user cache directory (when a file adapter plugin is
installed). Flags override a --config TOML file, which overrides the defaults. Repeat
--l2-adapter for a cascade; the order is the lookup order.
"""

_FIELD_DEFAULTS = {name: getattr(ServerConfig(), name) for name in ServerConfig.__struct_fields__}


def _help(text: str, field: str | None = None) -> str:
    if field is None:
        return text
    return f"{text} [default: {_FIELD_DEFAULTS[field]}]"


def serve(
    l1_size_gb: Annotated[
        Optional[float], typer.Option(help=_help("L1 arena size in GiB.", "l1_size_gb"))
    ] = None,
    eviction_policy: Annotated[
        Optional[str], typer.Option(help=_help("L1 eviction policy.", "eviction_policy"))
    ] = None,
    eviction_trigger_watermark: Annotated[
        Optional[float],
        typer.Option(help=_help("L1 usage fraction that starts eviction.", "eviction_trigger_watermark")),
    ] = None,
    eviction_ratio: Annotated[
        Optional[float],
        typer.Option(help=_help("Fraction of allocated L1 freed per round.", "eviction_ratio")),
    ] = None,
    l2_adapter: Annotated[
        Optional[list[str]],
        typer.Option(help='L2 adapter as JSON with a "type"; repeat for a cascade (order = lookup order).'),
    ] = None,
    l2_store_policy: Annotated[
        Optional[str], typer.Option(help=_help("Store policy.", "l2_store_policy"))
    ] = None,
    l2_prefetch_policy: Annotated[
        Optional[str], typer.Option(help=_help("Prefetch policy.", "l2_prefetch_policy"))
    ] = None,
    l2_prefetch_max_in_flight: Annotated[
        Optional[int], typer.Option(help=_help("Prefetch requests in flight.", "l2_prefetch_max_in_flight"))
    ] = None,
    chunk_size: Annotated[Optional[int], typer.Option(help=_help("Tokens per chunk.", "chunk_size"))] = None,
    host: Annotated[Optional[str], typer.Option(help=_help("Address to bind.", "host"))] = None,
    port: Annotated[Optional[int], typer.Option(help=_help("RPC port.", "port"))] = None,
    metrics_port: Annotated[
        Optional[int], typer.Option(help=_help("HTTP metrics port, 0 disables.", "metrics_port"))
    ] = None,
    metrics_host: Annotated[
        Optional[str],
        typer.Option(
            help=_help("Address of the HTTP endpoint; off loopback /status needs the token.", "metrics_host")
        ),
    ] = None,
    auth_token: Annotated[
        Optional[str],
        typer.Option(
            envvar="LMCACHE_TIERS_AUTH_TOKEN", help="Token clients must send; required off loopback."
        ),
    ] = None,
    no_shm: Annotated[
        Optional[bool], typer.Option("--no-shm", help="Disable the shared-memory data plane.")
    ] = None,
    gds_l1_path: Annotated[
        Optional[str],
        typer.Option(help="Keep L1 in blocks of a file under this directory (NVMe) instead of memory."),
    ] = None,
    gds_l1_use_direct_io: Annotated[
        Optional[bool],
        typer.Option(
            "--gds-l1-use-direct-io/--no-gds-l1-use-direct-io",
            help=_help("O_DIRECT I/O for the NVMe L1.", "gds_l1_use_direct_io"),
        ),
    ] = None,
    no_default_l2: Annotated[
        bool, typer.Option("--no-default-l2", help="Run L1 only when no adapter is configured.")
    ] = False,
    config: Annotated[
        Optional[str], typer.Option("--config", help="TOML file with the same keys (underscored).")
    ] = None,
    print_config: Annotated[
        bool, typer.Option("--print-config", help="Print the resolved configuration as JSON and exit.")
    ] = False,
    strict: Annotated[
        bool, typer.Option("--strict", help="Refuse to start when any installed plugin failed to load.")
    ] = False,
) -> None:
    plugin_set = load_plugins()
    if strict and plugin_set.errors:
        broken = "; ".join(f"{p.name}: {p.error}" for p in plugin_set.errors)
        fail(f"--strict: plugins failed to load: {broken}")
    file_values: dict[str, Any] = load_toml(config) if config else {}
    overrides = {
        "l1_size_gb": l1_size_gb,
        "eviction_policy": eviction_policy,
        "eviction_trigger_watermark": eviction_trigger_watermark,
        "eviction_ratio": eviction_ratio,
        "l2_store_policy": l2_store_policy,
        "l2_prefetch_policy": l2_prefetch_policy,
        "l2_prefetch_max_in_flight": l2_prefetch_max_in_flight,
        "chunk_size": chunk_size,
        "host": host,
        "port": port,
        "metrics_port": metrics_port,
        "metrics_host": metrics_host,
        "auth_token": auth_token,
        "no_shm": no_shm,
        "gds_l1_path": gds_l1_path,
        "gds_l1_use_direct_io": gds_l1_use_direct_io,
    }
    if not l2_adapter and "l2_adapters" not in file_values and not no_default_l2:
        file_values["l2_adapters"] = default_l2_adapters(plugin_set.registry)
    resolved = build_config(plugin_set.registry, file_values, overrides, l2_adapter)
    if not is_loopback(resolved.host) and not resolved.auth_token:
        fail(f"binding to {resolved.host} (not loopback) requires --auth-token or LMCACHE_TIERS_AUTH_TOKEN")
    if resolved.auth_token:
        from lmcache_tiers.wire.protocol import MAX_TOKEN_LEN

        if len(resolved.auth_token) > MAX_TOKEN_LEN:
            fail(f"--auth-token is longer than the {MAX_TOKEN_LEN} characters the protocol carries")
    if print_config:
        shown = config_to_builtins(resolved)
        if shown.get("auth_token"):
            shown["auth_token"] = "***"
        typer.echo(json.dumps(shown, indent=2))
        return
    try:
        from lmcache_tiers.server.app import run_server
    except ImportError as exc:
        fail(f"the server is not available in this installation ({exc})", 1)
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "INFO")
    raise typer.Exit(run_server(resolved, registry=plugin_set.registry))
