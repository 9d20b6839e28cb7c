"""Front ends: the wire protocols the server speaks, each one a plugin.

A front end turns the requests of one protocol (the native one, LMCache's MP protocol ...)
into calls on the shared :class:`~lmcache_tiers.storage.StorageManager`.  Several serve at
once, each on its own address, over the same L1 arena.  Core knows them only through this
contract:

* the plugin registers ``(name, "module:attr", config Struct)`` with
  ``tiers_register_frontends``; the config Struct subclasses :class:`FrontendConfig`;
* the server checks every front end's config (:meth:`FrontendConfig.check`) and the
  addresses they will listen on *before* L1 is allocated, so a mistake costs no start-up;
* it then calls ``factory(config, context)`` with a :class:`FrontendContext`; the factory
  binds its sockets (an address in use raises ``OSError``) and returns a :class:`Frontend`;
* ``start()`` begins serving on the front end's own threads; ``stop()`` asks it to stop
  (from a signal handler too); ``join()`` waits for it to drain, gives back every lock and
  reservation its clients still hold and closes its sockets;
* ``stats()`` feeds ``/metrics``, ``status()`` its section of ``/status``, ``health()``
  ``/healthz``;
* ``checks_auth_token`` (optional, False when absent) says whether its clients must
  present the server's auth token (``context.auth_token``): ``/status`` reports
  ``auth_required`` by it, so a protocol that carries no token never reads as protected.
"""

from __future__ import annotations

import ipaddress
import logging
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, runtime_checkable

from lmcache_tiers.config import FrontendConfig
from lmcache_tiers.endpoints import rpc_endpoint
from lmcache_tiers.errors import ConfigError, SettingRefused

if TYPE_CHECKING:
    from lmcache_tiers.config import FrontendSpec, ServerConfig
    from lmcache_tiers.registry import ComponentRegistry
    from lmcache_tiers.storage import StorageManager

__all__ = [
    "Frontend",
    "FrontendConfig",
    "FrontendContext",
    "FrontendStats",
    "check_frontends",
    "checks_auth_token",
    "create_frontend",
    "merged_stats",
]

logger = logging.getLogger(__name__)

#: how long a front end refused after it was built is given to close its sockets
_DISCARD_JOIN_S = 5.0


@dataclass
class FrontendStats:
    """Counters and gauges of one front end, read by ``/metrics`` and ``/status``.

    A front end bumps them from one thread of its own (its request loop); the HTTP thread
    reads them at scrape time, where a value one request stale is fine.
    """

    requests: Counter[str] = field(default_factory=Counter)  # by operation name
    failures: Counter[str] = field(default_factory=Counter)  # by reason
    stores: int = 0  # requests that stored at least one chunk
    store_chunks: int = 0
    store_bytes: int = 0
    # keys STORE requests named but did not newly store, by reason: skipped (L1 has the
    # key or a writer is filling it, named twice, aborted by the client) or refused (the
    # request was refused, or the client's reservation was gone at its commit)
    store_keys_skipped: Counter[str] = field(default_factory=Counter)
    store_keys_refused: Counter[str] = field(default_factory=Counter)
    retrieves: int = 0
    retrieve_chunks: int = 0
    retrieve_bytes: int = 0
    # gauges
    pending_prefetches: int = 0  # lookups whose result the client has not collected
    reserved_stores: int = 0  # reservations clients are filling
    locked_keys: int = 0  # keys read-locked on behalf of clients
    pool_tasks: int = 0  # requests running on worker threads
    # times the request loop stopped reading because its pool held its bound of requests
    # or of their bytes, and the seconds it spent so (RouterLoop); of those times, the ones
    # the byte bound held
    pool_backpressure: int = 0
    pool_backpressure_seconds: float = 0.0
    pool_backpressure_bytes: int = 0
    sessions: int = 0  # clients holding something or seen recently
    # what clients still held when the front end stopped (given back then)
    released_at_stop_locks: int = 0
    released_at_stop_reservations: int = 0

    def failure(self, reason: str, count: int = 1) -> None:
        self.failures[reason] += count

    def snapshot(self) -> dict[str, Any]:
        return {
            "requests": dict(self.requests),
            "failures": dict(self.failures),
            "stores": self.stores,
            "store_chunks": self.store_chunks,
            "store_bytes": self.store_bytes,
            "store_keys_skipped": dict(self.store_keys_skipped),
            "store_keys_refused": dict(self.store_keys_refused),
            "retrieves": self.retrieves,
            "retrieve_chunks": self.retrieve_chunks,
            "retrieve_bytes": self.retrieve_bytes,
            "in_flight": {
                "prefetches": self.pending_prefetches,
                "stores": self.reserved_stores,
                "pool_tasks": self.pool_tasks,
            },
            "pool_backpressure": {
                "times": self.pool_backpressure,
                "seconds": round(self.pool_backpressure_seconds, 3),
                "times_bytes_bound": self.pool_backpressure_bytes,
            },
            "locked_keys": self.locked_keys,
            "clients": self.sessions,
        }


def merged_stats(parts: Iterable[FrontendStats]) -> FrontendStats:
    """The sum of several front ends' counters and gauges.

    Safe while the front ends keep counting: each by-name counter is copied in one step
    (``dict()``, which their request loops cannot interleave) before it is added up --
    iterating a live one would raise "dictionary changed size" whenever a loop meets a new
    operation or failure reason meanwhile.
    """
    total = FrontendStats()
    for part in parts:
        for name in FrontendStats.__dataclass_fields__:
            mine, theirs = getattr(total, name), getattr(part, name)
            if isinstance(mine, Counter):
                mine.update(dict(theirs))
            else:
                setattr(total, name, mine + theirs)
    return total


@dataclass(frozen=True)
class FrontendContext:
    """What the server hands a front-end factory besides its config."""

    index: int  # position among the configured front ends
    name: str  # instance label, e.g. "0:native"
    storage: StorageManager
    server: ServerConfig  # chunk size, lock TTLs, no_shm ...
    host: str  # resolved from the config and the server's --host/--port
    port: int
    auth_token: str | None
    drain_timeout_s: float
    #: the whole ``/status`` document, for protocols that serve it (native STATUS)
    status: Callable[[], dict[str, Any]]
    #: call when the front end can no longer serve (its loop died): the server stops, exit 1
    fatal: Callable[[BaseException], None]

    @property
    def endpoint(self) -> str:
        return rpc_endpoint(self.host, self.port)


@runtime_checkable
class Frontend(Protocol):
    """A running front end (what a ``tiers_register_frontends`` factory returns)."""

    name: str  # the context's name

    @property
    def address(self) -> str:
        """The endpoint it serves, with the real port when port 0 was asked for."""
        ...

    def start(self) -> None:
        """Serve on the front end's own threads; returns at once."""
        ...

    def stop(self, *, force: bool = False) -> None:
        """Stop taking new requests and let in-flight ones finish (``force``: stop waiting
        for them).  Returns at once; safe to call from a signal handler and repeatedly."""
        ...

    def join(self, timeout: float | None = None) -> bool:
        """After :meth:`stop`: wait for the drain, give back every lock and reservation
        its clients hold and close its sockets.  True once done; also closes a front end
        that never started."""
        ...

    def stats(self) -> FrontendStats:
        """Its counters, for ``/metrics`` (summed over front ends, requests by front end)."""
        ...

    def status(self) -> dict[str, Any]:
        """JSON-able details for its entry in ``/status``'s ``frontends`` list."""
        ...

    def health(self) -> tuple[bool, str]:
        """(healthy, reason): False while stopping or when its loop has stalled."""
        ...

    def describe(self) -> str:
        """One line for the start-up banner, e.g. the protocol and the data path."""
        ...

    # Not a member of the protocol, so that a front end written without it stays one:
    # ``checks_auth_token: bool`` -- whether it refuses a request without the server's
    # auth token when one is configured (read by :func:`checks_auth_token`).


def checks_auth_token(frontend: Frontend) -> bool:
    """Whether ``frontend`` declares that it checks the auth token (``checks_auth_token =
    True``); one that does not say so is taken not to, as a protocol without credentials."""
    return getattr(frontend, "checks_auth_token", False) is True


def create_frontend(
    registry: ComponentRegistry,
    index: int,
    spec: FrontendSpec,
    storage: StorageManager,
    server: ServerConfig,
    *,
    auth_token: str | None,
    drain_timeout_s: float,
    status: Callable[[], dict[str, Any]],
    fatal: Callable[[BaseException], None],
) -> Frontend:
    """Build (and bind) the ``index``-th configured front end over ``storage``."""
    from lmcache_tiers.registry import Kind
    from lmcache_tiers.start_failures import create_component

    host, port = spec.config.address(server)
    context = FrontendContext(
        index=index,
        name=f"{index}:{spec.type}",
        storage=storage,
        server=server,
        host=host,
        port=port,
        auth_token=auth_token,
        drain_timeout_s=drain_timeout_s,
        status=status,
        fatal=fatal,
    )
    component = registry.get(Kind.FRONTEND, spec.type)
    # An OSError is the caller's to explain (the address it cannot listen on).
    what = f"front end {context.name}: {component.origin}"
    frontend = create_component(
        component, spec.config, context, what=what, path=f"$.frontends[{index}]", kept=(OSError,)
    )
    if not isinstance(frontend, Frontend):
        # It bound its sockets already: ``join`` is what closes them (a front end that
        # never started), so a refused one does not keep its port for the process's life.
        for method, args in (("stop", {"force": True}), ("join", {"timeout": _DISCARD_JOIN_S})):
            call = getattr(frontend, method, None)
            if not callable(call):
                continue
            try:
                call(**args)
            except Exception:
                logger.exception("discarding front end %s: %s failed", context.name, method)
        raise ConfigError(f"front end {context.name} built {type(frontend).__name__}, not a Frontend")
    return frontend


# -- start-up checks -----------------------------------------------------------------------

_WILDCARDS = frozenset({"", "*", "0.0.0.0", "::", "[::]"})


def _normalized_host(host: str) -> str:
    host = host.strip("[]")
    if host == "localhost":
        return "127.0.0.1"
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host.lower()


def _overlap(a: tuple[str, int], b: tuple[str, int]) -> bool:
    """Whether two listeners would take the same socket (port 0 never does: the kernel
    picks a free one)."""
    (host_a, port_a), (host_b, port_b) = a, b
    if host_a.startswith("ipc://") or host_b.startswith("ipc://"):
        return host_a == host_b
    if not port_a or port_a != port_b:
        return False
    if host_a.strip("[]") in _WILDCARDS or host_b.strip("[]") in _WILDCARDS:
        return True
    return _normalized_host(host_a) == _normalized_host(host_b)


#: the HTTP endpoint among the listeners check_frontends compares (always the last)
_HTTP_ENDPOINT = "the HTTP endpoint"


def _run_own_check(label: str, spec: FrontendSpec, server: ServerConfig, auth_token: str | None) -> None:
    """A front end's own check, its refusal prefixed with the front end's label.  A
    SettingRefused keeps its type (and setting), so ``serve`` can still name the setting
    by the flag or variable that set it."""
    try:
        spec.config.check(server, auth_token)
    except SettingRefused as exc:
        raise SettingRefused(exc.setting, exc.value, f"{label}: {exc.reason}") from None
    except ConfigError as exc:
        raise ConfigError(f"{label}: {exc}") from None


def _refuse_clash(server: ServerConfig, label: str, other_label: str, address: tuple[str, int]) -> NoReturn:
    """Refuse two listeners on one address, naming the setting that moves each one."""
    where = address[0] if address[0].startswith("ipc://") else f"{address[0]}:{address[1]}"
    if label == _HTTP_ENDPOINT:
        # Refused as metrics_port, which ``serve`` renames to the flag or variable that set
        # it: the reason names no setting of its own so it stays true under either name.
        raise SettingRefused(
            "metrics_port",
            server.metrics_port,
            f"{label} would listen on {where}, as {other_label} does: change it, or give "
            f'{other_label} another "port"',
        )
    raise ConfigError(
        f'{other_label} and {label} would both listen on {where}: give one of them another "port"'
    )


def check_frontends(server: ServerConfig, auth_token: str | None) -> None:
    """Everything about the front ends that can be refused before L1 exists: each one's own
    checks, and two listeners (front ends, the HTTP endpoint) on one address."""
    if not server.frontends:
        raise ConfigError(
            "no front end to serve: install lmcache-plugin-frontend-native, or give --frontend "
            "or frontends in --config"
        )
    listeners: list[tuple[str, tuple[str, int]]] = []
    for index, spec in enumerate(server.frontends):
        label = f"front end {index}:{spec.type}"
        _run_own_check(label, spec, server, auth_token)
        listeners.append((label, spec.config.address(server)))
    if server.metrics_port:
        listeners.append((_HTTP_ENDPOINT, (server.metrics_host, server.metrics_port)))
    for position, (label, address) in enumerate(listeners):
        for other_label, other in listeners[:position]:
            if _overlap(address, other):
                _refuse_clash(server, label, other_label, address)
