"""The serving process: StorageManager + RPC loop + HTTP endpoint, start-up and shutdown.

Shutdown on SIGINT/SIGTERM, in order: stop taking new work (new requests get
SHUTTING_DOWN), let in-flight requests finish or cancel them at the drain deadline, give
back every lock and reservation clients still hold, flush pending L2 stores, close the
storage (which unlinks the L1 segment), stop HTTP and print a summary.  A second signal
cuts the drain short.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from types import FrameType
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from lmcache_tiers import __version__
from lmcache_tiers.config import ServerConfig, config_to_builtins, redact_secrets
from lmcache_tiers.defaults import describe_default
from lmcache_tiers.endpoints import is_loopback, rpc_endpoint
from lmcache_tiers.errors import ConfigError, TiersError
from lmcache_tiers.l2.scan_progress import watch_scans
from lmcache_tiers.registry import ComponentRegistry
from lmcache_tiers.server.handlers import DataPlane, Handlers
from lmcache_tiers.server.http import HttpEndpoint
from lmcache_tiers.server.metrics import build_registry, render
from lmcache_tiers.server.rpc import RpcServer
from lmcache_tiers.server.stats import ServerStats
from lmcache_tiers.wire import protocol as p
from lmcache_tiers.wire.shm import segment_identity

if TYPE_CHECKING:
    from lmcache_tiers.storage import StorageManager

logger = logging.getLogger(__name__)

LOG_LEVEL_ENV = "LMCACHE_LOG_LEVEL"
AUTH_TOKEN_ENV = "LMCACHE_TIERS_AUTH_TOKEN"
_LEVELS = {"DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING, "ERROR": logging.ERROR}
#: adapter options never printed in the banner (credentials of remote stores)
#: the RPC loop must have turned within this long for /healthz to answer ok
_HEARTBEAT_LIMIT_S = 5.0


def configure_logging() -> None:
    """One log format for every Python logger of the server process, on stderr.

    The handler sits on the root logger, so plugin loggers (``lmcache_plugin_nixl.*``, a
    third-party plugin's package) and libraries print with the same timestamp, level and
    logger name as core.  ``LMCACHE_LOG_LEVEL`` (INFO when unset) applies to
    ``lmcache_tiers`` and to the package of every plugin entry point; other libraries keep
    Python's WARNING.  A process that configured logging itself (root already has a
    handler) keeps its handlers.  Log lines are plain, one per event: they end up in files
    and journals that people grep, unlike the banner and summary, which are for a terminal.
    """
    from importlib.metadata import entry_points

    from lmcache_tiers.plugins import ENTRY_POINT_GROUP

    raw = os.environ.get(LOG_LEVEL_ENV, "INFO").strip().upper()
    level = _LEVELS.get(raw)
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
    packages = {"lmcache_tiers"}
    packages.update(ep.value.split(":")[0].split(".")[0] for ep in entry_points(group=ENTRY_POINT_GROUP))
    for name in sorted(packages):
        logging.getLogger(name).setLevel(level if level is not None else logging.INFO)
    if level is None:
        logger.warning("%s=%r is not one of %s; using INFO", LOG_LEVEL_ENV, raw, ", ".join(_LEVELS))


def check_auth_token(token: str | None) -> None:
    """Refuse a token no request could carry: every request would be refused as MALFORMED."""
    if token is not None and len(token) > p.MAX_TOKEN_LEN:
        raise ConfigError(
            f"the auth token is {len(token)} characters long; the protocol carries at most {p.MAX_TOKEN_LEN}"
        )


def check_metrics_host(config: ServerConfig, token: str | None) -> None:
    """The HTTP endpoint binds an address of its own; beyond loopback, /status (pid, segment
    name, paths) is served only against the auth token, so one must exist."""
    if not config.metrics_port:
        return
    host = config.metrics_host
    if "://" in host:
        raise ConfigError(f"metrics_host {host!r}: give an address or name (HTTP does not serve on {host})")
    if not is_loopback(host) and not token:
        raise ConfigError(
            f"serving HTTP on {host} (not loopback) requires --auth-token or {AUTH_TOKEN_ENV}: "
            "/status answers only requests that carry it"
        )


class TiersServer:
    """One server: storage, RPC front end and HTTP endpoint. ``serve`` blocks."""

    def __init__(
        self,
        config: ServerConfig,
        *,
        registry: ComponentRegistry | None = None,
        auth_token: str | None = None,
        drain_timeout_s: float = 10.0,
        max_inline_bytes: int = 256 << 20,
        max_request_bytes: int = 1 << 30,
    ) -> None:
        from lmcache_tiers.storage import StorageManager

        if not is_loopback(config.host) and not auth_token:
            raise ConfigError(
                f"binding to {config.host} (not loopback) requires --auth-token or {AUTH_TOKEN_ENV}"
            )
        check_auth_token(auth_token)
        check_metrics_host(config, auth_token)
        endpoint = rpc_endpoint(config.host, config.port)
        self.config = config
        self.drain_timeout_s = drain_timeout_s
        self.auth_required = bool(auth_token)
        self.started = time.time()
        self.storage: StorageManager = StorageManager(config, registry)
        self.http: HttpEndpoint | None = None
        try:
            self.data_plane = self._data_plane()
            self.stats = ServerStats()
            self.handlers = Handlers(
                self.storage,
                chunk_size=config.chunk_size,
                data_plane=self.data_plane,
                stats=self.stats,
                status_provider=self.status,
                max_inline_bytes=max_inline_bytes,
            )
            self.rpc = RpcServer(
                self.handlers,
                endpoint,
                auth_token=auth_token,
                drain_timeout_s=drain_timeout_s,
                max_request_bytes=max(max_request_bytes, max_inline_bytes),
                # one inline chunk up to the advertised limit must fit in one frame
                max_frame_bytes=max_inline_bytes + p.MAX_HEADER_BYTES,
            )
            if config.metrics_port:
                metrics = build_registry(self.stats, self.storage_status)
                http_host = config.metrics_host
                try:
                    self.http = HttpEndpoint(
                        http_host,
                        config.metrics_port,
                        metrics=lambda: render(metrics),
                        status=self.status,
                        health=self.health,
                        status_token=None if is_loopback(http_host) else auth_token,
                    )
                except OSError as exc:
                    self.rpc.close()
                    raise OSError(
                        exc.errno, f"cannot serve HTTP on {http_host}:{config.metrics_port}: {exc.strerror}"
                    ) from None
        except BaseException:
            self.storage.close(drain_timeout_s=0.0)
            raise

    def _data_plane(self) -> DataPlane:
        if self.config.no_shm or not self.storage.l1.is_memory:
            return DataPlane()
        arena = self.storage.l1.arena
        device, inode = segment_identity(arena.name)
        return DataPlane(
            arena.name, arena.segment_size, device, inode, arena.generation_offset, arena.generation_block
        )

    @property
    def endpoint(self) -> str:
        return self.rpc.endpoint

    @property
    def http_url(self) -> str | None:
        return self.http.url if self.http is not None else None

    def status(self) -> dict[str, Any]:
        """The ``/status`` document (also the STATUS reply)."""
        server = {
            "version": __version__,
            "protocol_version": p.PROTOCOL_VERSION,
            "pid": os.getpid(),
            "endpoint": self.endpoint,
            "http": self.http_url,
            "uptime_s": round(time.time() - self.started, 3),
            "shm_segment": self.data_plane.shm_name or None,
            "auth_required": self.auth_required,
            "draining": self.rpc.draining,
            **self.stats.snapshot(),
        }
        return {"server": server, **self.storage_status()}

    def storage_status(self) -> dict[str, Any]:
        """The storage's status, with what L1 holds back for readers whose lease ended."""
        document = self.storage.status()
        document["l1"]["leases"] = self.storage.l1.lease_stats()._asdict()
        return document

    def health(self) -> tuple[bool, str]:
        if self.rpc.draining:
            return False, "shutting down"
        stalled = time.monotonic() - self.rpc.heartbeat
        if stalled > _HEARTBEAT_LIMIT_S:
            return False, f"rpc loop has not turned for {stalled:.1f}s"
        return True, "ok"

    def serve(self) -> None:
        if self.http is not None:
            self.http.start()
        self.rpc.serve()

    def request_stop(self, *, force: bool = False) -> None:
        self.rpc.request_stop(force=force)

    def close(self) -> dict[str, Any]:
        """After ``serve`` returned: flush L2, release everything; returns a summary."""
        before = self.storage.status()
        pending = before["store"]["in_flight_tasks"] + before["store"]["pending_batches"]
        flushed = self.storage.flush(timeout=self.drain_timeout_s)
        summary = {
            "uptime_s": time.time() - self.started,
            "requests": sum(self.stats.requests.values()),
            "stored_chunks": self.stats.store_chunks,
            "stored_bytes": self.stats.store_bytes,
            "retrieved_chunks": self.stats.retrieve_chunks,
            "retrieved_bytes": self.stats.retrieve_bytes,
            "lookups": before["requests"]["lookups"],
            "l1_hit_chunks": before["requests"]["l1_hit_chunks"],
            "l2_hit_chunks": before["requests"]["l2_hit_chunks"],
            "failures": sum(self.stats.failures.values()) + sum(before["failures"].values()),
            "client_locks_released": self.handlers.released_at_shutdown[0],
            "client_reservations_aborted": self.handlers.released_at_shutdown[1],
            "l2_stores_pending": pending,
            "l2_flushed": flushed,
            "l1_objects": before["l1"]["objects"],
        }
        self.storage.close(drain_timeout_s=self.drain_timeout_s)
        if self.http is not None:
            self.http.stop()
        return summary


# -- run_server: the `serve` command's body ------------------------------------------------


def run_server(
    config: ServerConfig,
    *,
    registry: ComponentRegistry | None = None,
    ready: threading.Event | None = None,
    banner: bool = True,
) -> int:
    """Serve until SIGINT/SIGTERM; returns the process exit code (0 after a clean stop,
    2 for a configuration mistake, 1 when the server cannot start for another reason)."""
    configure_logging()
    console = Console(highlight=False)
    errors = Console(stderr=True, highlight=False, soft_wrap=True)  # one line, whatever the width
    token = config.auth_token or os.environ.get(AUTH_TOKEN_ENV) or None
    hooks = _plugin_hooks()
    from lmcache_tiers.l1 import remove_stale_segments

    remove_stale_segments()
    try:
        server = TiersServer(config, registry=registry, auth_token=token)
    except ConfigError as exc:
        errors.print(f"[bold red]error:[/] {exc}")
        return 2
    except (TiersError, OSError) as exc:
        errors.print(f"[bold red]error:[/] cannot start the server: {exc}")
        return 1

    restore = _install_signal_handlers(server)
    code = 0
    try:
        if banner:
            console.print(_banner(server, token is not None))
            watch_scans(server.storage.adapters, console)
        _call_hook(hooks, "tiers_server_started", config=config, storage=server.storage)
        if ready is not None:
            ready.set()
        logger.info("serving on %s", server.endpoint)
        try:
            server.serve()
        except Exception:
            # A bug in the loop: still give everything back and unlink the segment.
            logger.exception("the RPC loop failed; shutting down")
            code = 1
        _call_hook(hooks, "tiers_server_stopping", config=config, storage=server.storage)
        summary = server.close()
    finally:
        restore()
    if banner:
        console.print(_summary(summary))
    return code


def _plugin_hooks() -> Any:
    try:
        from lmcache_tiers.plugins import load_plugins

        return load_plugins().manager.hook
    except Exception:  # lifecycle hooks are optional; discovery errors show in `plugins list`
        logger.exception("plugin discovery failed; lifecycle hooks are disabled")
        return None


def _call_hook(hooks: Any, name: str, **kwargs: Any) -> None:
    if hooks is None:
        return
    try:
        getattr(hooks, name)(**kwargs)
    except Exception:  # one faulty plugin must not stop the server starting or stopping
        logger.exception("plugin hook %s failed", name)


def _install_signal_handlers(server: TiersServer) -> Any:
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    signals = [signal.SIGINT, signal.SIGTERM]
    previous = {sig: signal.getsignal(sig) for sig in signals}
    received: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        # Only the flag and an eventfd write happen here: both are async-signal-safe.
        server.request_stop(force=len(received) > 1)

    for sig in signals:
        signal.signal(sig, on_signal)

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore


def _gib(size: float) -> str:
    return f"{size / 2**30:.2f} GiB"


def _banner(server: TiersServer, auth: bool) -> Panel:
    config = server.config
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold cyan", no_wrap=True)
    grid.add_column()
    grid.add_row("RPC", f"{server.endpoint}  ({'auth token required' if auth else 'no auth, loopback only'})")
    plane, l1 = server.data_plane, server.storage.l1
    if plane.shm_name:
        data_plane = f"shared memory /dev/shm/{plane.shm_name} ({_gib(plane.shm_size)})"
    elif not l1.is_memory:
        data_plane = f"inline bytes only (L1 is the file {l1.nvme_file_path})"
    else:
        data_plane = "inline bytes only (--no-shm)"
    grid.add_row("data plane", data_plane)
    http = server.http_url
    grid.add_row("HTTP", f"{http}/metrics  /healthz  /status" if http else "disabled (--metrics-port 0)")
    grid.add_row(
        "L1",
        f"{_gib(config.l1_size_bytes)}, eviction {config.eviction_policy} at "
        f"{config.eviction_trigger_watermark:.0%} frees {config.eviction_ratio:.0%}, "
        f"lock TTL {config.l1_lock_ttl_s:g}s",
    )
    adapters = redact_secrets(config_to_builtins(config)["l2_adapters"])
    if adapters:
        for index, adapter in enumerate(adapters):
            fields = ", ".join(
                f"{k}={v}"
                for k, v in adapter.items()
                if k != "type" and v is not None and v not in ([], (), {})
            )
            grid.add_row("L2" if index == 0 else "", f"{index}: {adapter['type']}  {fields}")
            default_note = describe_default(adapter)
            if default_note is not None:
                grid.add_row("", f"   {default_note}")
    else:
        grid.add_row("L2", "none (L1 only)")
    grid.add_row(
        "policies",
        f"store {config.l2_store_policy}, prefetch {config.l2_prefetch_policy} "
        f"(at most {config.l2_prefetch_max_in_flight} in flight)",
    )
    grid.add_row("chunk size", f"{config.chunk_size} tokens")
    grid.add_row("log level", logging.getLevelName(logging.getLogger("lmcache_tiers").getEffectiveLevel()))
    return Panel(grid, title=f"lmcache-tiers {__version__}  (pid {os.getpid()})", expand=False)


def _summary(summary: dict[str, Any]) -> Panel:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold cyan", no_wrap=True)
    grid.add_column()
    grid.add_row("uptime", f"{summary['uptime_s']:.1f} s, {summary['requests']} requests")
    grid.add_row("stored", f"{summary['stored_chunks']} chunks, {_gib(summary['stored_bytes'])}")
    grid.add_row("retrieved", f"{summary['retrieved_chunks']} chunks, {_gib(summary['retrieved_bytes'])}")
    grid.add_row(
        "lookups",
        f"{summary['lookups']}, hit chunks L1 {summary['l1_hit_chunks']} / L2 {summary['l2_hit_chunks']}",
    )
    grid.add_row("failures", str(summary["failures"]))
    grid.add_row(
        "released",
        f"{summary['client_locks_released']} client locks, "
        f"{summary['client_reservations_aborted']} unfinished stores aborted",
    )
    flushed = "all flushed" if summary["l2_flushed"] else "flush timed out"
    grid.add_row("L2 stores", f"{summary['l2_stores_pending']} pending at stop, {flushed}")
    return Panel(grid, title="lmcache-tiers stopped", expand=False)
