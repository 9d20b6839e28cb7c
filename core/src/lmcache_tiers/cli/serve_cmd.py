"""``lmcache-tiers serve``: LMCache's server flags, plus --config, --print-config, --strict.

Every option defaults to the ServerConfig default, so ``--help`` shows the value that
applies.  Only options given on the command line (or by their environment variable)
override the ``--config`` file; click reports where each value came from, so an option
set to its default on the command line still wins over the file.  The lists of installed
policies and adapter types in the help come from the plugin registry.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

import typer
from rich.markup import escape

from lmcache_tiers.cli import lmcache_flags as compat
from lmcache_tiers.cli.output import fail, warn
from lmcache_tiers.cli.stop_signals import handed_over
from lmcache_tiers.config import (
    CONFIG_PIPE_WAIT_S,
    ServerConfig,
    build_config,
    config_to_builtins,
    file_fields,
    load_toml,
    redact_secrets,
)
from lmcache_tiers.defaults import CACHE_DIR_ENV, claim_default_l2, default_l2_adapters, default_l2_dir
from lmcache_tiers.errors import ConfigError, SettingRefused
from lmcache_tiers.l2.preflight import preflight_adapters
from lmcache_tiers.plugins import PluginSet
from lmcache_tiers.registry import ComponentRegistry, Kind

logger = logging.getLogger("lmcache_tiers.cli.serve")

L1_PANEL = "L1"
EVICTION_PANEL = "L1 eviction"
L2_PANEL = "L2"
RPC_PANEL = "RPC"
HTTP_PANEL = "HTTP endpoint (/metrics, /healthz, /status)"

#: serve parameter -> (ServerConfig field, the flag shown in errors)
FLAG_FIELDS: dict[str, tuple[str, str]] = {
    "l1_size_gb": ("l1_size_gb", "--l1-size-gb"),
    "l1_align_bytes": ("l1_align_bytes", "--l1-align-bytes"),
    "l1_read_ttl_seconds": ("l1_lock_ttl_s", "--l1-read-ttl-seconds"),
    "l1_write_ttl_seconds": ("l1_write_ttl_s", "--l1-write-ttl-seconds"),
    "no_shm": ("no_shm", "--no-shm"),
    "shm_dir": ("l1_shm_dir", "--shm-dir"),
    "gds_l1_path": ("gds_l1_path", "--gds-l1-path"),
    "gds_l1_use_direct_io": ("gds_l1_use_direct_io", "--gds-l1-use-direct-io"),
    "eviction_policy": ("eviction_policy", "--eviction-policy"),
    "eviction_trigger_watermark": ("eviction_trigger_watermark", "--eviction-trigger-watermark"),
    "eviction_ratio": ("eviction_ratio", "--eviction-ratio"),
    "l2_store_policy": ("l2_store_policy", "--l2-store-policy"),
    "l2_prefetch_policy": ("l2_prefetch_policy", "--l2-prefetch-policy"),
    "l2_prefetch_max_in_flight": ("l2_prefetch_max_in_flight", "--l2-prefetch-max-in-flight"),
    "chunk_size": ("chunk_size", "--chunk-size"),
    "host": ("host", "--host"),
    "port": ("port", "--port"),
    "auth_token": ("auth_token", "--auth-token"),
    "metrics_host": ("metrics_host", "--metrics-host"),
    "metrics_port": ("metrics_port", "--metrics-port"),
    "shutdown_timeout": ("shutdown_timeout_s", "--shutdown-timeout"),
    "frontend_pool_max_mb": ("frontend_pool_max_mb", "--frontend-pool-max-mb"),
}

#: serve parameter -> (ServerConfig field, flag) of the options errors may name, FLAG_FIELDS and
#: those whose value is translated first
_ERROR_FLAGS = {
    **FLAG_FIELDS,
    "shm_name": ("l1_shm_name", "--shm-name"),
    "prometheus_port": ("metrics_port", "--prometheus-port"),
}

_D = ServerConfig()
#: the default L2's claim, held for the life of the serving process
_DEFAULT_L2_CLAIMS: list[object] = []


def config_flags() -> dict[str, list[str]]:
    """ServerConfig field -> the ``serve`` flags that set it (for the reference)."""
    flags: dict[str, list[str]] = {field: [flag] for field, flag in FLAG_FIELDS.values()}
    flags["no_shm"] = ["--no-shm", '--shm-name ""']
    flags["l1_shm_name"] = ["--shm-name"]
    flags["l2_adapters"] = ["--l2-adapter"]
    flags["frontends"] = ["--frontend"]
    flags["metrics_host"].append("--http-host")
    flags["metrics_port"] += ["--http-port", "--prometheus-port", "--disable-metrics"]
    return flags


def _installed(registry: ComponentRegistry, kind: Kind) -> str:
    return ", ".join(registry.names(kind)) or "none"


def serve_help(registry: ComponentRegistry) -> str:
    """The command's help: what runs with no flags, from the installed plugins."""
    try:
        defaults = default_l2_adapters(registry)
    except (ConfigError, OSError) as exc:
        # Built for every command (the help is part of the CLI): a bad environment variable
        # of the default L2, or a directory its sizing cannot stat (a name too long), is an
        # error where that L2 is used, not in `plugins list`.
        return _help_text(f"the embedded default L2, which cannot be used as configured ({exc})")
    if defaults:
        spec = escape(" ".join(json.dumps(adapter) for adapter in defaults))
        default_l2 = (
            f"the embedded default L2 --l2-adapter '{spec}' (capacity: 10 GiB or 10% of its "
            f"filesystem, whichever is smaller; {CACHE_DIR_ENV} moves its directory; "
            "--no-default-l2 runs L1 only)"
        )
    else:
        default_l2 = "no L2 (no installed adapter plugin provides the embedded default)"
    return _help_text(default_l2)


def _help_text(default_l2: str) -> str:
    return (
        "Run the KV-cache server.\n\n"
        f"With no --l2-adapter and no l2_adapters in --config it serves a {_D.l1_size_gb:g} GiB L1 "
        f"arena with {_D.eviction_policy} eviction and {default_l2}.  Flags override a --config "
        "TOML file, which overrides the defaults.  Repeat --l2-adapter for a cascade; the order "
        "is the lookup order.  LMCache server flags keep their meaning; those of features "
        "lmcache-tiers does not have are refused (docs/lmcache-compat.md)."
    )


def make_serve(plugin_set: PluginSet) -> Callable[..., None]:
    """The ``serve`` command function, its help listing what ``plugin_set`` installed."""
    registry = plugin_set.registry
    eviction = f"L1 eviction policy; installed: {_installed(registry, Kind.EVICTION_POLICY)}."
    adapter_types = _installed(registry, Kind.L2_ADAPTER)
    frontend_types = _installed(registry, Kind.FRONTEND)
    store = f"Which adapters new L1 objects go to; installed: {_installed(registry, Kind.STORE_POLICY)}."
    prefetch = (
        f"Which adapter each L2 hit loads from; installed: {_installed(registry, Kind.PREFETCH_POLICY)}."
    )

    def serve(
        ctx: typer.Context,
        l1_size_gb: float = typer.Option(
            _D.l1_size_gb, help="L1 arena size in GiB.", rich_help_panel=L1_PANEL
        ),
        l1_align_bytes: int = typer.Option(
            _D.l1_align_bytes, help="Alignment of L1 extents in bytes.", rich_help_panel=L1_PANEL
        ),
        l1_read_ttl_seconds: float = typer.Option(
            _D.l1_lock_ttl_s, help="Seconds before an unreleased read lock expires.", rich_help_panel=L1_PANEL
        ),
        l1_write_ttl_seconds: float = typer.Option(
            _D.l1_write_ttl_s,
            help="Seconds before an uncommitted write is dropped.",
            rich_help_panel=L1_PANEL,
        ),
        shm_name: Optional[str] = typer.Option(
            None,
            help='Name of the L1 shared-memory segment; "" turns shared memory off. '
            "\\[default: a unique name]",
            rich_help_panel=L1_PANEL,
        ),
        shm_dir: str = typer.Option(
            _D.l1_shm_dir,
            help="Directory (a tmpfs) for the L1 segment; one mounted with huge=always gives huge pages.",
            rich_help_panel=L1_PANEL,
        ),
        no_shm: bool = typer.Option(
            _D.no_shm,
            "--no-shm",
            help="No shared-memory data plane: bytes travel inline.",
            rich_help_panel=L1_PANEL,
        ),
        gds_l1_path: Optional[str] = typer.Option(
            None,
            help="Keep L1 in blocks of a file under this directory (NVMe) instead of memory. "
            "\\[default: none, L1 in memory]",
            rich_help_panel=L1_PANEL,
        ),
        gds_l1_use_direct_io: bool = typer.Option(
            _D.gds_l1_use_direct_io,
            "--gds-l1-use-direct-io/--no-gds-l1-use-direct-io",
            help="O_DIRECT I/O for the NVMe L1.",
            rich_help_panel=L1_PANEL,
        ),
        l1_init_size_gb: Optional[float] = typer.Option(
            None,
            help="Accepted for LMCache command lines: L1 is allocated and pre-faulted whole at start-up. "
            "\\[default: none]",
            rich_help_panel=L1_PANEL,
        ),
        eviction_policy: str = typer.Option(
            _D.eviction_policy, help=eviction, rich_help_panel=EVICTION_PANEL
        ),
        eviction_trigger_watermark: float = typer.Option(
            _D.eviction_trigger_watermark,
            help="L1 usage fraction that starts eviction.",
            rich_help_panel=EVICTION_PANEL,
        ),
        eviction_ratio: float = typer.Option(
            _D.eviction_ratio,
            help="Fraction of allocated L1 freed per round.",
            rich_help_panel=EVICTION_PANEL,
        ),
        l2_adapter: Optional[list[str]] = typer.Option(  # noqa: B008 - typer declares options so
            None,
            metavar="JSON",
            help=f'L2 adapter as JSON with a "type" (installed: {adapter_types}); repeat for a cascade. '
            "\\[default: the embedded default L2 described above, unless --config lists adapters]",
            rich_help_panel=L2_PANEL,
        ),
        l2_store_policy: str = typer.Option(_D.l2_store_policy, help=store, rich_help_panel=L2_PANEL),
        l2_prefetch_policy: str = typer.Option(
            _D.l2_prefetch_policy, help=prefetch, rich_help_panel=L2_PANEL
        ),
        l2_prefetch_max_in_flight: int = typer.Option(
            _D.l2_prefetch_max_in_flight, help="Prefetch requests in flight.", rich_help_panel=L2_PANEL
        ),
        no_default_l2: bool = typer.Option(
            False,
            "--no-default-l2",
            help="Run L1 only when no adapter is configured.",
            rich_help_panel=L2_PANEL,
        ),
        frontend: Optional[list[str]] = typer.Option(  # noqa: B008 - typer declares options so
            None,
            metavar="JSON",
            help=f'Front end as JSON with a "type" (installed: {frontend_types}); repeat to serve several '
            "protocols at once. \\[default: the native one on --host/--port, unless --config lists "
            "front ends]",
            rich_help_panel=RPC_PANEL,
        ),
        host: str = typer.Option(
            _D.host,
            help="Address to bind, or an ipc:// endpoint (front ends that give no host).",
            rich_help_panel=RPC_PANEL,
        ),
        port: int = typer.Option(
            _D.port, help="RPC port (front ends that give no port).", rich_help_panel=RPC_PANEL
        ),
        chunk_size: int = typer.Option(_D.chunk_size, help="Tokens per chunk.", rich_help_panel=RPC_PANEL),
        frontend_pool_max_mb: int = typer.Option(
            _D.frontend_pool_max_mb,
            metavar="MIB",
            help="MiB of requests each front end holds on its worker pool; at it, it reads no more "
            "requests until down to three quarters (at least the native max_request_bytes).",
            rich_help_panel=RPC_PANEL,
        ),
        shutdown_timeout: float = typer.Option(
            _D.shutdown_timeout_s,
            metavar="SECONDS",
            help="On SIGINT/SIGTERM/SIGHUP: how long in-flight requests are waited for, then again "
            "pending L2 stores, before what is left is abandoned (counted); a second signal, or "
            "SIGQUIT, stops at once (a stop a stuck plugin holds up ends 3 s later, or on the "
            "next signal: exit 1 or 3).  Exit status 3 when the stop gave up writes acknowledged "
            "to clients (even if a front end or the stop failed too: lost data outranks 1), "
            "0 when it lost nothing.",
            rich_help_panel=RPC_PANEL,
        ),
        auth_token: Optional[str] = typer.Option(
            None,
            envvar="LMCACHE_TIERS_AUTH_TOKEN",
            help="Token clients must send; required off loopback. \\[default: none]",
            rich_help_panel=RPC_PANEL,
        ),
        supported_transfer_mode: Optional[str] = typer.Option(
            None,
            callback=compat.value_check(*compat.VALUE_CHECKED["--supported-transfer-mode"]),
            metavar="engine_driven|auto",
            help="Accepted for LMCache command lines: clients always copy into the L1 segment "
            "themselves (engine-driven) or send bytes inline. \\[default: none]",
            rich_help_panel=RPC_PANEL,
        ),
        metrics_host: str = typer.Option(
            _D.metrics_host,
            "--metrics-host",
            "--http-host",
            help="Address of the HTTP endpoint.",
            rich_help_panel=HTTP_PANEL,
        ),
        metrics_port: int = typer.Option(
            _D.metrics_port,
            "--metrics-port",
            "--http-port",
            help="HTTP port; 0 turns the endpoint off.",
            rich_help_panel=HTTP_PANEL,
        ),
        prometheus_port: Optional[int] = typer.Option(
            None,
            help="LMCache's name for the /metrics port: the same as --metrics-port. \\[default: none]",
            rich_help_panel=HTTP_PANEL,
        ),
        disable_metrics: bool = typer.Option(
            False,
            "--disable-metrics",
            help="No HTTP endpoint (it serves /metrics, /healthz and /status together).",
            rich_help_panel=HTTP_PANEL,
        ),
        config: Optional[str] = typer.Option(
            None,
            "--config",
            help=(
                "TOML file with the same keys (underscored): a regular file, or a pipe "
                f"(<(...), /dev/stdin) its writer ends within {CONFIG_PIPE_WAIT_S:g} s. \\[default: none]"
            ),
        ),
        print_config: bool = typer.Option(
            False, "--print-config", help="Print the resolved configuration as JSON and exit."
        ),
        strict: bool = typer.Option(
            False,
            "--strict",
            help="Refuse to start when any installed plugin failed to load, or when a component "
            "name is registered by two distributions (contested: used by neither).",
        ),
        transport: Optional[str] = typer.Option(
            None, hidden=True, callback=compat.value_check(*compat.VALUE_CHECKED["--transport"])
        ),
        hash_algorithm: Optional[str] = typer.Option(
            None, hidden=True, callback=compat.value_check(*compat.VALUE_CHECKED["--hash-algorithm"])
        ),
        engine_type: Optional[str] = typer.Option(
            None, hidden=True, callback=compat.value_check(*compat.VALUE_CHECKED["--engine-type"])
        ),
        gds_l1_backend: Optional[str] = typer.Option(
            None, hidden=True, callback=compat.value_check(*compat.VALUE_CHECKED["--gds-l1-backend"])
        ),
        l1_use_lazy: Optional[bool] = typer.Option(None, "--l1-use-lazy/--no-l1-use-lazy", hidden=True),
        isolated_ipc: Optional[bool] = typer.Option(None, "--isolated-ipc/--no-isolated-ipc", hidden=True),
        l1_use_hugepages: Optional[bool] = typer.Option(
            None,
            "--l1-use-hugepages/--no-l1-use-hugepages",
            hidden=True,
            callback=compat.switch_check(compat.SWITCHES_REFUSED_ON["--l1-use-hugepages"]),
        ),
        run_script_api_enabled: Optional[bool] = typer.Option(
            None,
            "--run-script-api-enabled/--no-run-script-api-enabled",
            hidden=True,
            callback=compat.switch_check(compat.SWITCHES_REFUSED_ON["--run-script-api-enabled"]),
        ),
        separate_object_groups: Optional[bool] = typer.Option(
            None,
            "--separate-object-groups/--no-separate-object-groups",
            hidden=True,
            callback=compat.switch_check(compat.SWITCHES_REFUSED_ON["--separate-object-groups"]),
        ),
    ) -> None:
        given = {name for name in ctx.params if _given(ctx, name)}
        run_serve(plugin_set, ctx.params, given, _from_environment(ctx))

    serve.__doc__ = serve_help(registry)
    return serve


def _given(ctx: typer.Context, name: str) -> bool:
    source = ctx.get_parameter_source(name)
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")


def _from_environment(ctx: typer.Context) -> dict[str, str]:
    """Option name -> the environment variable its value came from (errors name that)."""
    variables: dict[str, str] = {}
    for param in ctx.command.params:
        source = ctx.get_parameter_source(param.name) if param.name else None
        if source is not None and source.name == "ENVIRONMENT" and isinstance(param.envvar, str):
            variables[str(param.name)] = param.envvar
    return variables


def flag_overrides(params: dict[str, Any], given: set[str]) -> tuple[dict[str, Any], list[str]]:
    """ServerConfig overrides from the options given, and the notes to log about them.

    Raises ConfigError for LMCache flags that contradict each other or a native flag.
    """
    overrides = {FLAG_FIELDS[name][0]: params[name] for name in given if name in FLAG_FIELDS}
    notes: list[str] = []
    if "prometheus_port" in given:
        port = params["prometheus_port"]
        if "metrics_port" in given and params["metrics_port"] != port:
            raise ConfigError(
                f"--prometheus-port {port} and --metrics-port/--http-port {params['metrics_port']} "
                "disagree: one HTTP endpoint serves /metrics, /healthz and /status; give one port"
            )
        overrides["metrics_port"] = port
    if params["disable_metrics"]:
        if overrides.get("metrics_port"):
            raise ConfigError(
                f"--disable-metrics turns the HTTP endpoint off, but port {overrides['metrics_port']} "
                "was asked for it; drop one of the two"
            )
        overrides["metrics_port"] = 0
        notes.append("--disable-metrics: the HTTP endpoint (/metrics, /healthz, /status) is off")
    if "shm_name" in given:
        if params["shm_name"] == "":
            overrides["no_shm"] = True
        elif params["no_shm"]:
            raise ConfigError(f"--shm-name {params['shm_name']!r} names a segment, but --no-shm turns it off")
        else:
            overrides["l1_shm_name"] = params["shm_name"]
    if "l1_init_size_gb" in given or params["l1_use_lazy"]:
        notes.append(
            "--l1-init-size-gb/--l1-use-lazy: L1 is allocated and pre-faulted whole at start-up "
            "(--l1-size-gb); there is no lazily grown L1"
        )
    if params["isolated_ipc"]:
        notes.append(
            "--isolated-ipc: clients that cannot map the L1 segment send bytes inline by themselves "
            '(LMCache\'s clients as pickled chunks: the lmcache_mp front end needs "allow_pickle": true)'
        )
    if params["supported_transfer_mode"] == "auto":
        notes.append(
            "--supported-transfer-mode auto: transfers here are engine-driven (clients copy) or inline"
        )
    return overrides, notes


_AT_FIELD = re.compile(r" - at `\$\.(\w+)`$")
_AT_ANY_FIELD = re.compile(r" - at `\$[^`]*`$")
#: the top-level field of any config path an error names (``$.l2_adapters[0].path``)
_AT_TOP_FIELD = re.compile(r" - at `\$\.(\w+)[^`]*`$")
#: the top-level field of a config path a refusal names its setting by
_TOP_OF_PATH = re.compile(r"\$\.(\w+)")


@dataclass(frozen=True)
class ConfigFile:
    """The ``--config`` file and the top-level fields whose values it gave (those a flag
    replaced left out): an error about one of them names the file."""

    path: str
    fields: frozenset[str]

    @classmethod
    def of(
        cls, path: str | None, file_values: Mapping[str, Any], replaced: Iterable[str] = ()
    ) -> ConfigFile | None:
        if path is None:
            return None
        return cls(path, frozenset(file_values) - frozenset(replaced))


def _source_of(field: str, given: set[str], from_env: Mapping[str, str]) -> str | None:
    """The flag, or environment variable, that set ServerConfig ``field``; None when the
    value came from the --config file or the defaults (errors then name the config key)."""
    for name in given:
        option_field, flag = _ERROR_FLAGS.get(name, ("", ""))
        if option_field == field:
            return from_env.get(name, flag)
    return None


def name_flag(
    exc: ConfigError,
    given: set[str],
    from_env: Mapping[str, str] | None = None,
    config_file: ConfigFile | None = None,
) -> ConfigError:
    """Prefix an error about a top-level field with the flag (or the environment variable)
    that set it, if one did, else with the ``--config`` file if it gave the value; name a
    refused setting (``SettingRefused``) the same way."""
    variables = from_env or {}
    if isinstance(exc, SettingRefused):
        source = _source_of(exc.setting, given, variables)
        if source is not None:
            return exc.with_name(source)
        # a setting inside a table (`$.frontends[0].port`) is the file's when its table is
        inside = _TOP_OF_PATH.match(exc.setting)
        field: str | None = exc.setting if inside is None else inside.group(1)
    else:
        found = _AT_FIELD.search(str(exc))
        if found is not None:
            source = _source_of(found.group(1), given, variables)
            if source is not None:
                return ConfigError(f"{source}: {exc}")
        top = _AT_TOP_FIELD.search(str(exc))
        field = None if top is None else top.group(1)
    if config_file is not None and field in config_file.fields:
        return ConfigError(f"--config {config_file.path}: {exc}")
    return exc


def _default_l2_error(exc: ConfigError) -> ConfigError:
    """An error about the embedded default L2, which the user did not write: say where it
    lives and the two ways out."""
    reason = _AT_ANY_FIELD.sub("", str(exc))
    return ConfigError(
        f"the embedded default L2 in {default_l2_dir()} cannot be used ({reason}); point "
        f"{CACHE_DIR_ENV} at a writable directory on a disk, or run without L2 (--no-default-l2)"
    )


def config_file_values(path: str) -> dict[str, Any]:
    """The ``--config`` file's top-level keys as field names (its key errors say "config
    field"); a list of adapters or front ends that is no list is refused naming the file."""
    values = load_toml(path)  # (its errors name the file)
    try:
        fields = file_fields(values)
    except ConfigError as exc:  # a key of the file's own: its name says where to look
        raise ConfigError(f"--config {path}: {exc}") from None
    for key in ("l2_adapters", "frontends"):
        # Checked here, where the file is known: a flag may replace the list later, and an
        # error about it would then name neither.
        if key in fields and not isinstance(fields[key], list):
            raise ConfigError(f"--config {path}: expected a list of tables (`[[{key}]]`) - at `$.{key}`")
    return fields


def refuse_segment_settings_with_nvme_l1(config: ServerConfig, explicit: Iterable[str]) -> None:
    """An NVMe L1 (``gds_l1_path``) is a file, with no shared-memory segment: a segment
    name, or a segment directory given (``explicit``: the fields a flag or the ``--config``
    file set), would be ignored without a word.  ConfigError naming the field."""
    if config.gds_l1_path is None:
        return
    if config.l1_shm_name is not None:
        field, value = "l1_shm_name", config.l1_shm_name
    elif "l1_shm_dir" in explicit:
        field, value = "l1_shm_dir", config.l1_shm_dir
    else:
        return
    raise ConfigError(
        f"{field} {value!r} is for an L1 in shared memory, but gds_l1_path {config.gds_l1_path!r} "
        f"puts L1 in a file, which has no segment; drop one of the two - at `$.{field}`"
    )


def refuse_listener_settings_no_front_end_uses(config: ServerConfig, explicit: Iterable[str]) -> None:
    """``host`` and ``port`` are the address of the front ends that give none of their own:
    given (``explicit``: the fields a flag or the ``--config`` file set) while every front
    end gives its own, they would be used by nothing, without a word.  SettingRefused
    naming the field."""
    given = set(explicit)
    if not config.frontends:
        return  # none installed: start-up refuses that, saying so
    for field in ("host", "port"):
        if field in given and all(getattr(spec.config, field) is not None for spec in config.frontends):
            raise SettingRefused(
                field,
                getattr(config, field),
                f"every front end gives its own {field}, so none listens on this one; drop it, "
                f'or leave "{field}" out of the front end that should take it',
            )


def warn_unused_broken_plugins(plugin_set: PluginSet) -> None:
    """One line per broken plugin once the configuration resolved without it.

    A configuration naming one of its components was refused already (the unknown name's
    error lists the broken plugins); one it does not use is no reason to stay down, but
    what is missing must not go unsaid.  ``--strict`` refuses both."""
    for plugin in plugin_set.unusable:
        warn(
            f"plugin {plugin.name} failed to load: {plugin.error}; serving without its components "
            "(--strict refuses to start)"
        )
    for line in plugin_set.contest_lines():
        # the configuration does not use the name (it would have been refused)
        warn(f"{line} (--strict refuses to start)")


def run_serve(
    plugin_set: PluginSet, params: dict[str, Any], given: set[str], from_env: Mapping[str, str] | None = None
) -> None:
    """The body of ``serve`` once click has parsed the options; ``from_env``: the options
    among ``given`` set by an environment variable, and its name."""
    if params["strict"] and plugin_set.errors:
        broken = "; ".join(f"{p.name}: {p.error}" for p in plugin_set.errors)
        fail(f"--strict: plugins failed to load: {broken}")
    if params["strict"] and plugin_set.contest_lines():
        fail(f"--strict: {'; '.join(plugin_set.contest_lines())}")
    overrides, notes = flag_overrides(params, given)
    # Keys as field names first (a file may write `[[l2-adapters]]`), so that the default L2
    # is added only where the file has no adapters of its own.
    # An empty --config (an unset variable) is a missing file, not "no file".
    file_values = config_file_values(params["config"]) if params["config"] is not None else {}
    adapters = params["l2_adapter"]
    replaced = [name for name, flag in (("l2_adapters", adapters), ("frontends", params["frontend"])) if flag]
    config_file = ConfigFile.of(params["config"], file_values, replaced)
    uses_default_l2 = not adapters and "l2_adapters" not in file_values and not params["no_default_l2"]
    if uses_default_l2:
        try:
            file_values["l2_adapters"] = default_l2_adapters(plugin_set.registry)
        except OSError as exc:  # its directory cannot be sized (a name too long): one line
            raise _default_l2_error(ConfigError(str(exc))) from None
        for spec in file_values["l2_adapters"]:
            # Said as it is: neither a writable directory nor --no-default-l2 is the way out
            # of two distributions registering the default L2's type.
            plugin_set.registry.get(Kind.L2_ADAPTER, spec["type"])
    try:
        resolved = build_config(plugin_set.registry, file_values, overrides, adapters, params["frontend"])
        refuse_segment_settings_with_nvme_l1(resolved, [*overrides, *file_values])
        refuse_listener_settings_no_front_end_uses(resolved, [*overrides, *file_values])
        if uses_default_l2 and not params["print_config"]:
            if file_values["l2_adapters"]:
                # A second default server gets a hint, not the directory-lock refusal the
                # pre-flight (or, later, the adapter) would give: claimed before either.
                _DEFAULT_L2_CLAIMS.append(claim_default_l2())
            preflight_adapters(plugin_set.registry, resolved)
    except ConfigError as exc:
        if uses_default_l2 and "`$.l2_adapters[0]" in str(exc):
            raise _default_l2_error(exc) from None
        raise name_flag(exc, given, from_env, config_file) from exc
    warn_unused_broken_plugins(plugin_set)
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "INFO")
    try:
        from lmcache_tiers.server.app import check_serving, run_server
        from lmcache_tiers.server.leave import leave_past_stuck_threads
        from lmcache_tiers.server.logs import configure_logging
    except ImportError as exc:
        fail(f"the server is not available in this installation ({exc})", 1)
    # Refused before anything is printed or allocated (--print-config checks it too).
    try:
        check_serving(resolved, resolved.auth_token)
    except ConfigError as exc:
        raise name_flag(exc, given, from_env, config_file) from exc
    configure_logging()
    for note in notes:
        logger.info("%s", note)
    if params["print_config"]:
        shown = redact_secrets(config_to_builtins(resolved))
        typer.echo(json.dumps(shown, indent=2))
        return
    handed_over()  # the server's own stop handling, start-up included, from here on
    code = run_server(
        resolved,
        registry=plugin_set.registry,
        name_setting=lambda exc: name_flag(exc, given, from_env, config_file),
    )
    leave_past_stuck_threads(code)
    raise typer.Exit(code)
