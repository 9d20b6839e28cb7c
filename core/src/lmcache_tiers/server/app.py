"""The serving process: StorageManager + front ends + HTTP endpoint, start-up and shutdown.

Front ends are plugins (``tiers_register_frontends``); each listens on its own address and
runs its own threads over the one StorageManager.  Start-up checks everything it can before
L1 exists (front-end configs, addresses that would clash, the HTTP host), then builds the
storage (which pre-faults L1), the front ends (which bind) and the HTTP endpoint.

Before the storage exists, the machine is checked too (:mod:`~lmcache_tiers.server.preflight`:
adapter paths, ports, the L1 size): pre-faulting a large L1 takes seconds.

Shutdown on SIGINT/SIGTERM/SIGHUP, in order: every front end stops taking new work and lets
in-flight requests finish (or cancels them at the drain deadline), then gives back every
lock and reservation its clients still hold; pending L2 stores are flushed up to the same
deadline (:mod:`~lmcache_tiers.server.flush`), the storage is closed (abandoning, and
counting, what the flush did not store; this unlinks the L1 segment), HTTP stops and a
summary is printed.  A step of the close that raises is logged and the others still run
(:class:`StopFailed`, exit 1; 3 when it lost acknowledged writes).  A second signal, or
SIGQUIT as the first, cuts the drain and the flush short; a forced stop a stuck thread
holds up is ended by :mod:`~lmcache_tiers.server.stuck_stop`.  A signal during start-up
(building L1 and the adapters) interrupts it: what was built is closed, the L1 segment
unlinked, and the exit code is 128 + the signal's number.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape

from lmcache_tiers import __version__
from lmcache_tiers.burst import BurstLog, report_held_back
from lmcache_tiers.close_steps import logged_close_failure
from lmcache_tiers.config import ServerConfig, default_frontends, redact_url_secrets
from lmcache_tiers.endpoints import is_loopback
from lmcache_tiers.errors import ConfigError, SettingRefused, TiersError
from lmcache_tiers.frontend import (
    Frontend,
    FrontendStats,
    check_frontends,
    checks_auth_token,
    create_frontend,
)
from lmcache_tiers.l2.scan_progress import watch_scans
from lmcache_tiers.registry import ComponentRegistry, Kind
from lmcache_tiers.server.banner import start_banner, stop_summary
from lmcache_tiers.server.console import ServeConsole
from lmcache_tiers.server.flush import ABANDONED_FAILURES, flush_l2, pending_l2_stores
from lmcache_tiers.server.frontend_totals import HeldFrontendTotals
from lmcache_tiers.server.heap import start_up_heap_frozen
from lmcache_tiers.server.http import HttpEndpoint
from lmcache_tiers.server.logs import configure_logging
from lmcache_tiers.server.metrics import TiersCollector, build_registry, render
from lmcache_tiers.server.preflight import (
    listen_error,
    listener_setting,
    open_files_limit,
    open_files_refusal,
    preflight,
)
from lmcache_tiers.server.priority import request_threads_favoured
from lmcache_tiers.server.stuck_stop import (
    EXIT_ACKNOWLEDGED_WRITES_LOST,
    StuckStopGuard,
    files_created,
    graceful_stop_window_s,
)
from lmcache_tiers.server.thread_crashes import ThreadCrashes
from lmcache_tiers.wire import protocol as p

if TYPE_CHECKING:
    from lmcache_tiers.storage import StorageManager

logger = logging.getLogger(__name__)

AUTH_TOKEN_ENV = "LMCACHE_TIERS_AUTH_TOKEN"
#: failure reason of a front end whose ``stats()``, ``status()`` or ``health()`` raised
FRONTEND_REPORT_ERROR = "frontend_report_error"
#: what the server reports instead of a front end's answer that raised, by method
_WHAT_A_FAILED_REPORT_COSTS = {
    "stats": "its counters in the sums are the ones it last reported, its own samples and gauges left out",
    "status": "its /status entry is its name and the error",
    "health": "the server reports itself unhealthy",
}
#: how long a front end that does not finish its drain is waited for beyond the deadline
_JOIN_GRACE_S = 5.0
#: descriptors a front end's ZeroMQ context takes when its first socket starts it
#: (measured: 6 -- the context's mailbox, the reaper's and the I/O thread's poller and
#: mailbox, the socket's mailbox).  libzmq aborts the process when it cannot create a
#: poller, so their room is made sure of first, with a margin.
_FRONTEND_START_DESCRIPTORS = 8


class StopFailed(TiersError):
    """A step of the server's close raised (the storage's close, the HTTP endpoint's stop).

    Raised by :meth:`TiersServer.close` only after every other step ran: the resources are
    released whatever one step did.  ``acknowledged_lost`` counts the acknowledged writes
    not stored in L2 (as far as the storage counted them before it failed)."""

    def __init__(self, failure: str, acknowledged_lost: int) -> None:
        super().__init__(
            f"the stop failed: {failure}; "
            f"{acknowledged_lost} objects acknowledged to clients were not stored in L2"
        )
        self.failure = failure
        self.acknowledged_lost = acknowledged_lost


def check_metrics_host(config: ServerConfig, token: str | None) -> None:
    """The HTTP endpoint binds an address of its own; beyond loopback, /status (pid, segment
    name, paths) is served only against the auth token, so one must exist."""
    if not config.metrics_port:
        return
    host = config.metrics_host
    # Refused as the setting (serve names the flag that gave it, --metrics-host).
    if "://" in host:
        raise SettingRefused("metrics_host", host, f"give an address or name (HTTP does not serve on {host})")
    if not is_loopback(host) and not token:
        raise SettingRefused(
            "metrics_host",
            host,
            f"serving HTTP on it (not loopback) requires --auth-token, {AUTH_TOKEN_ENV} or auth_token "
            "in --config: /status answers only requests that carry it",
        )


def check_hosts_resolve(config: ServerConfig) -> None:
    """A listener's host naming no address (``locahost``) is refused as such: read as "not
    loopback", it was told to add an auth token, and with one, that it is not an address
    of this machine."""
    listeners: list[tuple[int | None, str]] = [
        (index, spec.config.address(config)[0]) for index, spec in enumerate(config.frontends)
    ]
    if config.metrics_port:
        listeners.append((None, config.metrics_host))
    for index, host in listeners:
        if "://" in host or host in ("", "*"):
            continue  # an ipc:// path, or a scheme refused elsewhere; "*": every address
        try:
            socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM)
        # UnicodeError (a ValueError): a label IDNA refuses; ValueError: a NUL
        except (socket.gaierror, ValueError) as exc:
            reason = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
            raise SettingRefused(
                listener_setting(config, index, "host"),
                host,
                f"names no address ({reason}); give an address or a name this machine resolves",
            ) from None


def check_l1_geometry(config: ServerConfig) -> None:
    """What the L1 asks for that no machine gives: room for one extent, a segment directory
    given by an absolute path, and for an NVMe L1 an alignment ``O_DIRECT`` transfers take."""
    from lmcache_tiers.l1.nvme import DIRECT_IO_ALIGN

    align = config.l1_align_bytes
    if config.l1_size_bytes < align:
        raise SettingRefused(
            "l1_size_gb",
            f"{config.l1_size_gb:g}",
            f"smaller than one L1 extent of {align} bytes (the L1 alignment); give a larger size",
        )
    if config.gds_l1_path is None:
        if not os.path.isabs(config.l1_shm_dir):
            raise SettingRefused("l1_shm_dir", config.l1_shm_dir, "give an absolute path")
    elif align % DIRECT_IO_ALIGN:
        raise SettingRefused(
            "l1_align_bytes", align, f"an NVMe L1 (on a file path) needs a multiple of {DIRECT_IO_ALIGN}"
        )


def check_serving(config: ServerConfig, token: str | None) -> None:
    """Every check that needs neither L1 nor a socket (``serve --print-config`` runs them too)."""
    check_l1_geometry(config)
    check_hosts_resolve(config)
    check_frontends(config, token)
    check_metrics_host(config, token)


class TiersServer:
    """One server: storage, front ends and HTTP endpoint. ``serve`` blocks."""

    def __init__(
        self,
        config: ServerConfig,
        *,
        registry: ComponentRegistry | None = None,
        auth_token: str | None = None,
        stale_segments_removed: Sequence[str] = (),
        stale_segments_kept: Sequence[str] = (),
    ) -> None:
        """``stale_segments_removed``: the L1 segments of killed servers that start-up
        removed before this server (``run_server`` does), reported in /metrics and /status;
        ``stale_segments_kept``: those of creators not seen here that it left in place."""
        from lmcache_tiers.plugins import load_registry
        from lmcache_tiers.storage import StorageManager

        registry = registry if registry is not None else load_registry()
        if not config.frontends:
            config = _with_default_frontends(config, registry)
        check_serving(config, auth_token)
        # Imported before L1 is allocated: a front end whose code cannot load costs no start-up.
        for spec in config.frontends:
            registry.get(Kind.FRONTEND, spec.type).load()
        # Paths, ports and the L1 size against the machine, before pre-faulting takes seconds.
        preflight(config, registry)
        self.config = config
        # plugin name -> why it failed to load: serve started without its components
        self.failed_plugins = dict(sorted(registry.failed_plugins.items()))
        self.stale_segments_removed = list(stale_segments_removed)
        self.stale_segments_kept = list(stale_segments_kept)
        self.drain_timeout_s = drain_timeout_s = config.shutdown_timeout_s
        # whether a token is configured; a front end requires it only if it checks it
        self.has_auth_token = bool(auth_token)
        # monotonic: the uptime is a duration, which a step of the wall clock must not move
        self.started = time.monotonic()
        self._stopping = False
        self._force = False
        # what asked for the stop and what forced it ("SIGTERM", "a second signal"), for the log
        self._stop_reason: str | None = None
        self._force_reason: str | None = None
        self._fatal: BaseException | None = None
        # failures of the server itself, by reason: the HTTP endpoint's refusals and
        # failures (its threads count them) and front ends' reports that raised
        self._own_failures: Counter[str] = Counter()
        self._own_failures_lock = threading.Lock()
        self._report_errors = BurstLog(logger, FRONTEND_REPORT_ERROR)
        self.http: HttpEndpoint | None = None
        self._thread_crashes: ThreadCrashes | None = None  # installed once built
        self._collector: TiersCollector | None = None  # what /metrics counts itself
        # the front ends' sum for /status, /metrics and the stop's summary: a front end
        # whose stats() fails for a read adds the counters it last reported, so no total
        # falls back silently (/status names it under frontend_stats_held)
        self._frontend_totals = HeldFrontendTotals(self.frontend_stats)
        self.frontends: list[Frontend] = []
        self._wake_read = self._wake_write = -1
        # Nothing between the storage and the cleanup below: a stop signal raises where
        # start-up is, and one landing in between would leave the L1 segment behind.
        self.storage: StorageManager = StorageManager(config, registry)
        try:
            # Made after the storage, inside the cleanup: a storage that cannot be built
            # (a taken segment name, a failing adapter) leaks no descriptors into a process
            # that goes on, such as one that retries start-up.
            self._wake_read, self._wake_write = os.pipe()
            os.set_blocking(self._wake_write, False)
            for index, spec in enumerate(config.frontends):
                try:
                    _make_sure_descriptors_are_free(_FRONTEND_START_DESCRIPTORS)
                    frontend = create_frontend(
                        registry,
                        index,
                        spec,
                        self.storage,
                        config,
                        auth_token=auth_token,
                        drain_timeout_s=drain_timeout_s,
                        status=self.status,
                        fatal=self._on_fatal,
                    )
                except OSError as exc:  # taken since the pre-flight probe
                    host, port = spec.config.address(config)
                    raise listen_error(config, index, host, port, exc) from None
                self.frontends.append(frontend)
            if config.metrics_port:
                self._collector = TiersCollector(
                    self.frontend_stats,
                    self.storage_status,
                    failed_plugins=self.failed_plugins,
                    stale_segments_removed=len(self.stale_segments_removed),
                    stale_segments_kept=len(self.stale_segments_kept),
                    totals=self._frontend_totals,
                )
                metrics = build_registry(self.frontend_stats, self.storage_status, self._collector)
                http_host = config.metrics_host
                try:
                    self.http = HttpEndpoint(
                        http_host,
                        config.metrics_port,
                        metrics=lambda: render(metrics),
                        status=self.status,
                        health=self.health,
                        status_token=None if is_loopback(http_host) else auth_token,
                        failed=self._count_failure,
                    )
                except OSError as exc:
                    raise listen_error(config, None, http_host, config.metrics_port, exc) from None
        except BaseException:
            # Every step logs what it meets and the next still runs: the start-up's own
            # error is the one to raise.
            self._close_frontends()
            self._close_storage()
            self._release_endpoints()
            raise
        # Built: from now on a thread an exception ends is counted and logged (until close).
        self._thread_crashes = ThreadCrashes(self._count_failure)
        self._thread_crashes.install()

    @property
    def endpoint(self) -> str:
        """The first front end's address (the native one unless configured otherwise)."""
        return self.frontends[0].address

    @property
    def http_url(self) -> str | None:
        return self.http.url if self.http is not None else None

    def frontend_stats(self) -> list[tuple[str, FrontendStats]]:
        """Each front end's name and counters.  A front end is a plugin: one whose
        ``stats()`` raises (or answers something else) is left out, counted and logged --
        its bug costs its own samples, not the scrape, ``/status`` or the stop's close."""
        readable = []
        for frontend in self.frontends:
            try:
                stats = frontend.stats()
                if not isinstance(stats, FrontendStats):
                    raise TypeError(f"stats() returned {type(stats).__name__}, not FrontendStats")
            except Exception as exc:
                self._report_failed(frontend, "stats", exc)
                continue
            readable.append((frontend.name, stats))
        return readable

    def _requires_token(self, frontend: Frontend) -> bool:
        return self.has_auth_token and checks_auth_token(frontend)

    def _frontend_status(self, frontend: Frontend) -> dict[str, Any]:
        """A front end's ``/status`` entry, or its name and the error its ``status()``
        raised; the entry with whether its clients must present the auth token."""
        try:
            return {**frontend.status(), "auth_required": self._requires_token(frontend)}
        except Exception as exc:
            self._report_failed(frontend, "status", exc)
            return {"name": frontend.name, "error": f"{type(exc).__name__}: {exc}"}

    def _report_failed(self, frontend: Frontend, method: str, exc: Exception) -> None:
        self._count_failure(FRONTEND_REPORT_ERROR)
        self._report_errors.warn(
            f"{frontend.name}:{method}",
            "front end %s: %s() failed, %s: %s: %s",
            frontend.name,
            method,
            _WHAT_A_FAILED_REPORT_COSTS.get(method, "left out of what the server reports"),
            type(exc).__name__,
            exc,
        )

    def status(self) -> dict[str, Any]:
        """The ``/status`` document (also the native STATUS reply)."""
        totals = self._frontend_totals.read()
        l1 = self.storage.l1
        shm = l1.arena.name if l1.is_memory and not self.config.no_shm else None
        pages = l1.arena.pages if l1.is_memory else None
        server = {
            "version": __version__,
            "protocol_version": p.PROTOCOL_VERSION,
            "pid": os.getpid(),
            "endpoint": self.endpoint,
            "endpoints": [frontend.address for frontend in self.frontends],
            "http": self.http_url,
            "uptime_s": round(time.monotonic() - self.started, 3),
            "shm_segment": shm,
            "l1_pages": pages.status() if pages is not None else None,
            "auth_required": any(self._requires_token(frontend) for frontend in self.frontends),
            "draining": self._stopping,
            "plugins_failed_to_load": dict(self.failed_plugins),
            "l1_stale_segments_removed": list(self.stale_segments_removed),
            "l1_stale_segments_kept": list(self.stale_segments_kept),
            **totals.total.snapshot(),
            # front ends whose stats() could not be read now: their counters in the sums
            # above are the ones they last reported
            "frontend_stats_held": totals.held,
        }
        frontends = [self._frontend_status(frontend) for frontend in self.frontends]
        return {"server": server, "frontends": frontends, **self.storage_status()}

    def storage_status(self) -> dict[str, Any]:
        """The storage's status, with what L1 holds back for readers whose lease ended, and
        the server's own failures (the HTTP endpoint's, front ends' reports that raised)
        among the failures."""
        document = self.storage.status()
        document["l1"]["leases"] = self.storage.l1.lease_stats()._asdict()
        with self._own_failures_lock:
            own = dict(self._own_failures)
        if own:
            failures = dict(document.get("failures", {}))
            for reason, count in own.items():
                failures[reason] = failures.get(reason, 0) + count
            document["failures"] = failures
        return document

    def _own_failure_count(self) -> int:
        """The server's own failures and those of the scrapes themselves."""
        scrapes = sum(self._collector.own_failures().values()) if self._collector is not None else 0
        with self._own_failures_lock:
            return sum(self._own_failures.values()) + scrapes

    def _count_failure(self, reason: str) -> None:
        with self._own_failures_lock:
            self._own_failures[reason] += 1

    def health(self) -> tuple[bool, str]:
        if self._stopping:
            return False, "shutting down"
        for frontend in self.frontends:
            try:
                healthy, reason = frontend.health()
            except Exception as exc:
                self._report_failed(frontend, "health", exc)
                return False, f"{frontend.name}: its health check failed: {type(exc).__name__}: {exc}"
            if not healthy:
                return False, f"{frontend.name}: {reason}"
        return True, "ok"

    def serve(self) -> None:
        """Serve until :meth:`request_stop`, then stop every front end; raises when a front
        end reported that it can no longer serve."""
        if self.http is not None:
            self.http.start()
        for frontend in self.frontends:
            frontend.start()
        # poll, not select: with the soft limit raised to the hard one (pre-flight) the
        # pipe of a process holding many descriptors may be above select's FD_SETSIZE.
        waker = select.poll()
        waker.register(self._wake_read, select.POLLIN)
        while not self._stopping:
            # Woken by request_stop (a signal handler may call it) or a failing front end.
            if waker.poll(1000):
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_read, 64)
            # Warnings a burst held back, once their window ends: else a burst followed by
            # quiet leaves its last drops in no log line.
            report_held_back(time.monotonic())
        self._log_stop()
        self._stop_frontends()
        if self._fatal is not None:
            raise TiersError(f"a front end failed: {self._fatal}") from self._fatal

    def _stop_frontends(self) -> None:
        for frontend in self.frontends:
            frontend.stop(force=self._force)
        deadline = time.monotonic() + self.drain_timeout_s + _JOIN_GRACE_S
        for frontend in self.frontends:
            if not frontend.join(max(0.0, deadline - time.monotonic())):
                logger.warning("%s did not stop within the drain deadline", frontend.name)

    def _log_stop(self) -> None:
        """Say what stops the server (logged here, not in the signal handler)."""
        if self._stop_reason is None:
            return
        if self._force:
            logger.warning(
                "stopping at once on %s: in-flight requests and pending L2 stores are not waited for",
                self._force_reason,
            )
        else:
            logger.info(
                "stopping on %s: draining for up to %gs, then flushing L2 for as long",
                self._stop_reason,
                self.drain_timeout_s,
            )

    def request_stop(self, *, force: bool = False, reason: str | None = None) -> None:
        """Begin a graceful stop (``force``: stop waiting for in-flight work); ``reason``
        names what asked for it (a signal).  Safe from a signal handler: flags, the front
        ends' own stop, and a pipe write."""
        self._stopping = True
        if self._stop_reason is None:
            self._stop_reason = reason
        if force:
            self._force = True
            if self._force_reason is None:
                self._force_reason = reason or "a forced stop"
            for frontend in self.frontends:
                frontend.stop(force=True)
        with contextlib.suppress(OSError):
            os.write(self._wake_write, b"x")

    def _on_fatal(self, exc: BaseException) -> None:
        self._fatal = exc
        self.request_stop()

    def close(self, console: Console | None = None) -> dict[str, Any]:
        """After ``serve`` returned: flush L2 (progress on ``console``; a second signal
        abandons it), release everything; returns a summary."""
        self._close_frontends()
        try:
            stats = self._frontend_totals.read().total
            before = self.storage.status()
            pending = pending_l2_stores(self.storage)
            flushed = flush_l2(self.storage, self.drain_timeout_s, lambda: self._force_reason, console)
        except BaseException:
            # Whatever cut the close short, the storage still closes (counting what the
            # flush did not store), the L1 segment is unlinked and the ports go back.
            self._release_the_rest()
            raise
        # The flush was the drain: what is still pending is abandoned now, and counted.
        storage_failure = self._close_storage()
        failures = self.storage.failures()
        abandoned = sum(failures.get(name, 0) for name in ABANDONED_FAILURES)
        if abandoned:
            logger.warning(
                "%d objects acknowledged to clients were not stored in L2 before the stop", abandoned
            )
        summary = {
            "uptime_s": time.monotonic() - self.started,
            "requests": sum(stats.requests.values()),
            "stored_chunks": stats.store_chunks,
            "stored_bytes": stats.store_bytes,
            "retrieved_chunks": stats.retrieve_chunks,
            "retrieved_bytes": stats.retrieve_bytes,
            "lookups": before["requests"]["lookups"],
            "l1_hit_chunks": before["requests"]["l1_hit_chunks"],
            "l2_hit_chunks": before["requests"]["l2_hit_chunks"],
            # what /metrics counts: the front ends', the storage's, the server's own (HTTP
            # endpoint, front ends' reports) and the scrapes' own
            "failures": sum(stats.failures.values()) + sum(failures.values()) + self._own_failure_count(),
            "client_locks_released": stats.released_at_stop_locks,
            "client_reservations_aborted": stats.released_at_stop_reservations,
            "l2_stores_pending": pending,
            "l2_flushed": flushed,
            "l2_flush_abandoned": not flushed and self._force,
            "l2_flush_abandoned_by": self._force_reason if not flushed and self._force else None,
            "l2_objects_abandoned": abandoned,
            "l1_objects": before["l1"]["objects"],
        }
        failed = [step for step in (storage_failure, self._release_endpoints()) if step is not None]
        report_held_back()  # every warning still held back, the stop's own included
        if failed:
            raise StopFailed("; ".join(failed), abandoned)
        return summary

    def _release_the_rest(self) -> None:
        """Close the storage, the HTTP endpoint and the wake-up pipe (a close cut short:
        what cut it is raised, each step's own failure only logged)."""
        self._close_storage()
        self._release_endpoints()

    def _close_storage(self) -> str | None:
        """Close the storage (abandoning, and counting, what L2 did not get); what failed, or None.

        A close whose steps failed ran all the others, L1's release among them, and logged
        each failure with its traceback: it is named here, not logged again.  A close that
        raised anything else stopped part-way, maybe before releasing L1, whose segment
        outlives the process: L1 is then released on its own (its close is idempotent)."""
        # Imported with the storage (see __init__): loaded by now, not on the CLI's path.
        from lmcache_tiers.storage import StorageCloseFailed

        try:
            self.storage.close(drain_timeout_s=0.0)
        except StorageCloseFailed as failed:
            return f"closing the storage failed: {failed}"
        except Exception as exc:
            failure = _logged_failure("closing the storage", exc)
            _release_step("releasing L1 after the storage's failed close", self.storage.l1.close)
            return failure
        return None

    def _release_endpoints(self) -> str | None:
        """Give back the HTTP port and the wake-up pipe, and stop counting threads' crashes;
        what failed, or None."""
        if self._thread_crashes is not None:
            self._thread_crashes.uninstall()
        failure = None
        if self.http is not None:
            failure = _release_step("stopping the HTTP endpoint", self.http.stop)
        self._close_pipe()
        return failure

    def _close_frontends(self) -> None:
        """Stop and close front ends (those that never started, or after ``serve``).

        A front end whose ``stop`` or ``join`` raises is logged and passed over: what
        comes after (the others' close, the L2 flush, the storage's close and the L1
        segment's unlink) must happen whatever one plugin does."""
        for frontend in self.frontends:
            try:
                frontend.stop(force=True)
            except Exception:
                logger.exception("stopping front end %s failed", frontend.name)
        for frontend in self.frontends:
            try:
                frontend.join(_JOIN_GRACE_S)
            except Exception:
                logger.exception("closing front end %s failed", frontend.name)

    def _close_pipe(self) -> None:
        for fd in (self._wake_read, self._wake_write):
            if fd < 0:
                continue  # never made, or closed already
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_read = self._wake_write = -1


def _release_step(what: str, step: Callable[[], None]) -> str | None:
    """Run one step of a close; a raise is logged with its traceback and returned as text
    (``what failed: Type: message``), so that the steps after it still run."""
    try:
        step()
    except Exception as exc:
        return _logged_failure(what, exc)
    return None


def _logged_failure(what: str, exc: Exception) -> str:
    """Log a failed step of a close with its traceback (as text); what failed, as text."""
    return logged_close_failure(logger, what, exc, "the other resources are released regardless")


def _with_default_frontends(config: ServerConfig, registry: ComponentRegistry) -> ServerConfig:
    import msgspec

    return msgspec.structs.replace(config, frontends=default_frontends(registry))


# -- run_server: the `serve` command's body ------------------------------------------------


def run_server(
    config: ServerConfig,
    *,
    registry: ComponentRegistry | None = None,
    ready: threading.Event | None = None,
    banner: bool = True,
    name_setting: Callable[[ConfigError], ConfigError] | None = None,
) -> int:
    """Serve until SIGINT/SIGTERM/SIGHUP (SIGQUIT: stop at once); returns the process exit
    code (0 after a stop, forced or not, that lost nothing, 3
    (:data:`EXIT_ACKNOWLEDGED_WRITES_LOST`) after one that gave up acknowledged writes --
    also when a front end or the stop failed too, 2 for a configuration mistake, 1 when
    the server cannot start for another reason, a front end failed while serving or the
    stop itself failed (one line says so) and no acknowledged write was lost, 128 + the
    signal's number when a signal interrupted start-up).  ``name_setting`` rewords a
    refusal found at start-up (``serve`` names a setting by the flag that set it)."""
    configure_logging()
    console = ServeConsole(highlight=False)
    errors = Console(stderr=True, highlight=False, soft_wrap=True)  # one line, whatever the width
    token = config.auth_token or os.environ.get(AUTH_TOKEN_ENV) or None
    hooks = _plugin_hooks()
    from lmcache_tiers.l1 import remove_stale_segments

    # Each removal and each segment left in place is logged as it happens; the lists are
    # kept for /metrics and /status.
    kept: list[str] = []
    stale = remove_stale_segments(config.l1_shm_dir, kept) if os.path.isdir(config.l1_shm_dir) else []
    # Installed before the L1 segment exists: under Python's default action a SIGTERM
    # while start-up pre-faults L1 (seconds per GiB) ended the process at once, leaving
    # the whole segment in /dev/shm (a named one is never reaped, and refuses the next
    # start).
    signals = _StopSignals()
    signals.install()
    try:
        try:
            server = _build_server(config, registry, token, signals, stale, kept)
        except StartUpInterrupted as interrupted:
            signals.log_deferred()
            logger.warning("start-up interrupted by %s: stopped before serving", interrupted.name)
            return 128 + interrupted.signum
        except ConfigError as exc:
            signals.log_deferred()
            _print_error(errors, str(exc if name_setting is None else name_setting(exc)))
            return 2
        except Exception as exc:
            signals.log_deferred()
            if _ran_out_of_open_files(exc):
                # Past the pre-flight's floor (more adapters or plugins than it counts):
                # the limit is what to change, whichever socket or file hit it.
                logger.debug("start-up ran out of open files", exc_info=True)
                _print_error(errors, str(open_files_refusal(open_files_limit(), while_starting=True)))
                return 2
            if isinstance(exc, (TiersError, OSError)):
                _print_error(errors, f"cannot start the server: {exc}")
                return 1
            # A plugin's own exception while it starts (a backend it cannot reach, a
            # library it cannot load): what was built is closed already; one line, and
            # the traceback for whoever debugs the plugin.
            logger.debug("start-up failed", exc_info=True)
            _print_error(errors, f"cannot start the server: {type(exc).__name__}: {exc}")
            return 1
        try:
            summary, code = _serve_until_stopped(server, config, hooks, console, ready, banner)
        except StopFailed as failed:
            # Logged with its traceback already; for whoever started serve, one line.
            _print_error(errors, str(failed))
            return _exit_status(1, failed.acknowledged_lost)
    finally:
        signals.restore()
    # Counted and logged by the close already; the status says it to whoever started serve.
    code = _exit_status(code, summary["l2_objects_abandoned"])
    if banner:
        _print_stop_summary(console, summary)
    return code


def _make_sure_descriptors_are_free(count: int) -> None:
    """Raise EMFILE (an OSError) unless ``count`` more descriptors can be opened now: a
    start short of them is the one-line refusal naming ``ulimit -n``, not libzmq's abort,
    which would leave the L1 segment behind."""
    opened: list[int] = []
    try:
        for _ in range(count):
            opened.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
    finally:
        for descriptor in opened:
            os.close(descriptor)


def _exit_status(code: int, acknowledged_lost: int) -> int:
    """``code`` of a server that served, unless its stop lost acknowledged writes: then
    :data:`EXIT_ACKNOWLEDGED_WRITES_LOST`, which outranks a failure (1) -- the failure is
    in the error line and the log, lost data must show in the status."""
    return EXIT_ACKNOWLEDGED_WRITES_LOST if acknowledged_lost else code


def _ran_out_of_open_files(exc: BaseException) -> bool:
    """EMFILE anywhere in the chain: a plugin wraps the socket or file error it met."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if getattr(current, "errno", None) == errno.EMFILE:
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def _print_stop_summary(console: Console, summary: dict[str, Any]) -> None:
    """The stop's summary, for people (what L2 did not get is logged too).  A terminal
    gone (the hangup that stopped the server) refuses it: no failure of the stop, done by
    now, so a warning and the exit code unchanged, and ``serve`` still goes on to leave
    past threads stuck in calls instead of waiting for them at exit."""
    try:
        console.print(stop_summary(summary))
    except OSError as exc:
        logger.warning("the stop summary could not be shown: %s", exc)


def _build_server(
    config: ServerConfig,
    registry: ComponentRegistry | None,
    token: str | None,
    signals: _StopSignals,
    stale_segments_removed: list[str],
    stale_segments_kept: list[str],
) -> TiersServer:
    """The server, with the stop signals handed over to it."""
    server = TiersServer(
        config,
        registry=registry,
        auth_token=token,
        stale_segments_removed=stale_segments_removed,
        stale_segments_kept=stale_segments_kept,
    )
    try:
        signals.attach(server)
    except StartUpInterrupted:
        # The signal came just before the hand-over: the server exists, close it.  A
        # failing step is logged by the close, which still releases the rest.
        with contextlib.suppress(StopFailed):
            server.close()
        raise
    return server


def _serve_until_stopped(
    server: TiersServer,
    config: ServerConfig,
    hooks: Any,
    console: Console,
    ready: threading.Event | None,
    banner: bool,
) -> tuple[dict[str, Any], int]:
    """Serve until a stop, then close the server: (its summary, the exit code)."""
    code = 0
    if banner:
        # For people only: a failure here (a front end's ``describe`` raising, a closed
        # stdout) must neither keep the server from serving nor skip its close below.
        try:
            console.print(start_banner(server))
            watch_scans(server.storage.adapters, console)
        except Exception as exc:
            logger.error("the start-up banner could not be shown: %s: %s", type(exc).__name__, exc)
            logger.debug("start-up banner failed", exc_info=True)
    _call_hook(hooks, "tiers_server_started", config=config, storage=server.storage)
    if ready is not None:
        ready.set()
    for frontend in server.frontends:
        logger.info("serving %s on %s", frontend.name, frontend.address)
    try:
        with start_up_heap_frozen(), request_threads_favoured():
            server.serve()
    except Exception:
        # A bug in a front end: still give everything back and unlink the segment.
        logger.exception("serving failed; shutting down")
        code = 1
    _call_hook(hooks, "tiers_server_stopping", config=config, storage=server.storage)
    return server.close(console if banner else None), code


def _print_error(errors: Console, message: str) -> None:
    """``error: message`` on one line: the message is text (``[0]`` in a config path is not
    markup), its line breaks are folded, and passwords inside URLs are left out (a
    component's refusal may quote the URL it refused)."""
    errors.print(f"[bold red]error:[/] {escape(redact_url_secrets(' '.join(message.split())))}")


def _plugin_hooks() -> Any:
    try:
        from lmcache_tiers.plugins import load_plugins

        return load_plugins().manager.hook
    except Exception:  # lifecycle hooks are optional; discovery errors show in `plugins list`
        logger.exception("plugin discovery failed; lifecycle hooks are disabled")
        return None


def _call_hook(hooks: Any, name: str, **kwargs: Any) -> None:
    """One faulty plugin must neither stop the server starting or stopping nor keep the
    other plugins' implementations from running."""
    if hooks is None:
        return
    from lmcache_tiers.plugins import call_each

    def failed(plugin: str, exc: Exception) -> None:
        logger.error("plugin %s: hook %s failed: %s: %s", plugin, name, type(exc).__name__, exc, exc_info=exc)

    call_each(getattr(hooks, name), failed, **kwargs)


class StartUpInterrupted(BaseException):
    """A stop signal (:data:`STOP_SIGNALS`) while the server was being built, raised where start-up was.

    Start-up unwinds through its cleanup (the L1 segment is unlinked, adapters closed, the
    ports given back) as it does for KeyboardInterrupt, which it is a sibling of: an
    ``except Exception`` in a plugin does not swallow it.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
        self.name = signal.Signals(signum).name


#: the signals that stop the server, for the whole of ``run_server``.  SIGHUP (the terminal
#: or session that started it went away) stops it as SIGTERM does; SIGQUIT (Ctrl-\) stops
#: it at once, as a second signal does.  Under their default actions both ended the process
#: on the spot: the L1 segment and the ipc socket left behind, and the acknowledged stores
#: still queued for L2 lost without a count or a log line.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
#: among them, those that stop at once without the drain and the flush
FORCING_SIGNALS = frozenset({signal.SIGQUIT})
#: among them, those left ignored when whoever started the process ignored them, and why
#: they were: ``nohup`` ignores SIGHUP so that the server outlives its terminal; a
#: non-interactive shell starts a background job (``serve &`` in a script) with SIGINT and
#: SIGQUIT ignored so that the terminal's Ctrl-C and Ctrl-\\, meant for the script's
#: foreground command, do not reach it.  SIGTERM is never kept ignored: it always stops.
KEPT_IGNORED: dict[int, str] = {
    signal.SIGINT: "Ctrl-C is for the foreground command of the shell that started serve in the background",
    signal.SIGHUP: "started under nohup: serve outlives its terminal",
    signal.SIGQUIT: "Ctrl-\\ is for the foreground command of the shell that started serve in the background",
}


class _StopSignals:
    """The stop signals (:data:`STOP_SIGNALS`) for the whole of ``run_server``, start-up included.

    Until :meth:`attach` the first signal interrupts start-up (:class:`StartUpInterrupted`)
    and later ones are ignored, so that they cannot cut the cleanup it unwinds through.
    A first signal while start-up is handling an exception (the clean-up of a start-up
    that failed, in the server's or a plugin's ``except`` or ``finally``) waits instead:
    raised there it would cut that clean-up short and leave the L1 segment or a socket
    behind.  The start-up's own error then ends it; one that got past its exception is
    interrupted at :meth:`attach`.  A second signal interrupts at once (a clean-up that
    hangs).
    Once attached, the first asks the server for a graceful stop (SIGQUIT: a forced one)
    and any later one forces it; a forced stop that does not finish, or a graceful one
    still running past all its deadlines, is ended by :class:`StuckStopGuard`, which hears
    the signals without the main thread.  A signal of
    :data:`KEPT_IGNORED` the process was started with ignored (``nohup``, a script's
    background job) stays ignored, and one line says so.
    Only the main thread can have handlers: elsewhere (a server run inside a test) signals
    are left as they are.
    """

    def __init__(self) -> None:
        self._server: TiersServer | None = None
        self._received = 0
        self._previous: dict[int, Any] = {}
        # StartUpInterrupted was raised: its clean-up runs, later signals are ignored
        self._interrupted = False
        # the signal that came while start-up handled an exception, not raised there
        self._deferred: int | None = None
        # tells the log about a waiting signal as it comes (see _tell_deferred)
        self._notice_write = -1
        self._notice_thread: threading.Thread | None = None
        # stop signals inherited ignored and left so (KEPT_IGNORED)
        self._kept_ignored: Sequence[int] = ()
        # the handlers are this process's (run_server on the main thread)
        self._installed = False
        # ends the process when a forced stop is held up for good (see stuck_stop)
        self._guard: StuckStopGuard | None = None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        kept_ignored = []
        for sig in STOP_SIGNALS:
            previous = signal.getsignal(sig)
            if sig in KEPT_IGNORED and previous == signal.SIG_IGN:
                kept_ignored.append(sig)
                continue
            self._previous[sig] = previous
            signal.signal(sig, self._on_signal)
        # Said once the server is built (attach): a start-up refused before that stays the
        # one line it is, however whoever started serve left its signals.
        self._kept_ignored = kept_ignored
        self._installed = True
        self._start_notices()

    def _start_notices(self) -> None:
        """A thread that logs a signal left waiting as soon as it comes: the handler may not
        log (it may interrupt a write to the log's own stream) nor start a thread (it may
        interrupt one starting), so it writes the signal's number to a pipe this reads."""
        read_fd, self._notice_write = os.pipe()
        self._notice_thread = threading.Thread(
            target=_tell_deferred, args=(read_fd,), name="stop-signal-notices", daemon=True
        )
        self._notice_thread.start()

    def attach(self, server: TiersServer) -> None:
        """Hand the signals to a server that is built; a signal deferred meanwhile
        interrupts the start-up now (``_build_server`` closes the server)."""
        if self._deferred is not None:
            self._interrupted = True
            raise StartUpInterrupted(self._deferred)
        self._server = server
        self._stop_notices()  # serving: a signal stops the server, none waits
        if self._installed:
            self._start_guard(server)
        if self._kept_ignored:
            _log_kept_ignored(self._kept_ignored)

    def _start_guard(self, server: TiersServer) -> None:
        """The handler runs on the main thread only: a forced stop that thread cannot
        finish (stuck on a lock a plugin holds) is ended by the guard's own thread.  A
        guard that cannot start (no descriptor left for its pipe) costs that safety net
        only, said in the log: the server, built by now, must not be left unclosed."""
        guard = StuckStopGuard(
            STOP_SIGNALS,
            FORCING_SIGNALS,
            files_created(server.storage, _endpoints(server)),
            has_l2=bool(server.storage.adapters),
            pending_l2_stores=lambda: pending_l2_stores(server.storage),
            graceful_window_s=graceful_stop_window_s(server.drain_timeout_s, _JOIN_GRACE_S),
        )
        try:
            guard.start()
        except Exception as exc:
            logger.warning(
                "a stop held up by a stuck thread will not be ended (its guard cannot start: %s: %s)",
                type(exc).__name__,
                exc,
            )
            return
        self._guard = guard

    def log_deferred(self) -> None:
        """Say that a signal waited for the clean-up of a start-up that failed (logged
        here, not in the handler)."""
        if self._deferred is not None and not self._interrupted:
            logger.warning(
                "%s came while a failed start-up cleaned up: the clean-up finished first",
                signal.Signals(self._deferred).name,
            )

    def restore(self) -> None:
        if self._guard is not None:
            self._guard.finish()  # the stop is over (or never began): nothing to end
            self._guard = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        self._stop_notices()

    def _stop_notices(self) -> None:
        """End the notice thread (once no signal can wait any more) and its pipe."""
        if self._notice_thread is not None:
            write_fd, self._notice_write = self._notice_write, -1  # the handler writes no more
            os.close(write_fd)  # the thread reads the end of the pipe and returns
            self._notice_thread.join()
            self._notice_thread = None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._received += 1
        if self._server is not None:
            # Only flags and pipe writes happen here: safe whatever the main thread was doing.
            name = signal.Signals(signum).name
            if self._received > 1:
                self._server.request_stop(force=True, reason="a second signal")
            else:
                self._server.request_stop(force=signum in FORCING_SIGNALS, reason=name)
            return
        if self._interrupted:
            return  # the start-up unwinds through its clean-up: nothing cuts it short
        if self._deferred is None and sys.exc_info()[1] is not None:
            # Start-up is handling an exception (cleaning up after a failure, as its
            # except or finally blocks do): raised here, this would cut that short.
            self._deferred = signum
            if self._notice_write >= 0:
                os.write(self._notice_write, bytes([signum]))
            return
        self._interrupted = True
        raise StartUpInterrupted(signum)


def _endpoints(server: TiersServer) -> list[str]:
    """The front ends' addresses (a front end is a plugin: one whose ``address`` raises is
    left out, its ipc socket then left behind by a stop the guard ends)."""
    addresses = []
    for frontend in server.frontends:
        try:
            addresses.append(frontend.address)
        except Exception as exc:
            logger.debug("front end %s: address failed: %s: %s", frontend.name, type(exc).__name__, exc)
    return addresses


def _tell_deferred(read_fd: int) -> None:
    """Log each signal number read from ``read_fd`` as one that waits for the start-up to
    finish handling an error; return at the pipe's end.  A step retrying inside an
    ``except`` block (a plugin reconnecting) can hold such a signal for long: the operator
    learns why the server has not stopped, and how to stop it at once."""
    try:
        while number := os.read(read_fd, 1):
            logger.warning(
                "%s came while the start-up handles an error (cleaning up, or a step retrying): "
                "it stops once that is done; send it again to stop at once",
                signal.Signals(number[0]).name,
            )
    finally:
        os.close(read_fd)


def _log_kept_ignored(signals: Sequence[int]) -> None:
    """One line naming the stop signals inherited ignored, which therefore do not stop the
    server: whoever expects Ctrl-C (or a hangup) to stop it learns why it does not."""
    reasons = "; ".join(f"{signal.Signals(sig).name} ({KEPT_IGNORED[sig]})" for sig in signals)
    logger.info("stop signals ignored as inherited: %s; SIGTERM stops the server", reasons)
