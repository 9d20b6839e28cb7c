"""The Mooncake client of one adapter: its set-up, its timeouts, and getting it back.

``MooncakeDistributedStore.setup`` against a master that does not answer retries for
about 90 s, and a failed client cannot be used again, so the connection is made on a
thread of its own: the adapter opens at once and its calls fail (``MooncakeUnavailable``,
counted) until the client is up; a failed attempt is retried with a growing pause.  Once
connected, the client itself reconnects to a master that restarted.

Mooncake's timeouts are environment variables its C++ client reads when a client is set
up; they are set from ``operation_timeout_s`` just before each set-up (under a lock, so
two adapters of one process each get their own), except those the operator set before
the first adapter started: the operator's values win.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import math
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from lmcache_plugin_mooncake.calls import CallPool, CallTimeout
from lmcache_plugin_mooncake.config import MooncakeStoreConfig
from lmcache_plugin_mooncake.diagnosis import segment_name_holder, unanswered_services, unreachable_service
from lmcache_plugin_mooncake.headers import HeaderLanes, address_of
from lmcache_plugin_mooncake.metadata_plugins import missing_metadata_plugin
from lmcache_tiers.plugin import BackendUnavailableError, ConfigError, TiersError

logger = logging.getLogger(__name__)

#: what the codes Mooncake's calls return mean (as its client logs them)
ERROR_NAMES = {
    -200: "no room in the pool",
    -600: "invalid parameters",
    -704: "object not found",
    -705: "object already exists",
    -706: "object has a lease",
    -800: "transfer failed",
    -900: "master RPC failed",
    -901: "master RPC timed out",
}
INVALID_PARAMS = -600
NOT_FOUND = -704
EXISTS = -705
NO_ROOM = -200
_RPC_TIMED_OUT = -901
#: codes that say the master did not answer: the whole batch fails (counted as a
#: backend error), not a key at a time
UNREACHABLE = frozenset({-900, -901})
#: first and longest pause between two connection attempts
_RETRY_FIRST_S = 1.0
_RETRY_MAX_S = 30.0
#: Mooncake's reconnection to a master that failed a call (about 4 s, fixed): how long a
#: call given up then may stay inside besides its timeouts
RECONNECT_S = 5.0
#: longest each service is asked after a failed set-up (see ``unanswered_services``)
_DIAGNOSIS_TIMEOUT_S = 2.0
#: how long a client left unclosed is offered its close again (see ``_keep_until_answered``)
_UNCLOSED_RETRY_FOR_S = 60.0
INSTALL_HINT = (
    "pip install 'lmcache-plugin-mooncake[non-cuda]' (or mooncake-transfer-engine on a CUDA "
    "machine); the client needs libibverbs1, librdmacm1 and libnuma1"
)


def describe(code: int) -> str:
    name = ERROR_NAMES.get(code)
    return f"{code} ({name})" if name else str(code)


class MooncakeError(TiersError):
    """A Mooncake call failed for a whole batch (the master is unreachable, ...)."""


class MooncakeUnavailable(MooncakeError):
    """No connected Mooncake client (yet): the call was not made."""


class SetupRefused(MooncakeError):
    """Mooncake refused to set up a client with what the config asks for (memory it cannot
    allocate): another attempt fails the same way."""


class MasterUnreachable(MooncakeError):
    """The master did not answer a call (``UNREACHABLE`` codes): the whole batch failed."""


def timeout_environment(timeout_s: float) -> dict[str, str]:
    """The Mooncake environment variables ``operation_timeout_s`` stands for."""
    seconds = str(max(1, math.ceil(timeout_s)))
    return {
        "MC_RPC_TIMEOUT_MS": str(max(1, round(timeout_s * 1000))),
        "MC_TCP_PROGRESS_TIMEOUT_SEC": seconds,
        "MC_TCP_STATUS_TIMEOUT_SEC": seconds,
        # One set-up attempt per connection attempt: the retries are this module's.
        "MC_STORE_CLIENT_SETUP_RETRIES": "1",
    }


#: held while the environment is set for, and a client is set up with, one timeout
_SETUP_LOCK = threading.Lock()
#: the timeout variables the operator set before this module first touched them
_OPERATOR_SET: frozenset[str] | None = None


def apply_timeout_environment(timeout_s: float) -> dict[str, str]:
    """Put the timeouts of ``timeout_s`` in the environment (call with ``_SETUP_LOCK``
    held); returns the values in effect."""
    global _OPERATOR_SET
    wanted = timeout_environment(timeout_s)
    if _OPERATOR_SET is None:
        _OPERATOR_SET = frozenset(name for name in wanted if name in os.environ)
    for name, value in wanted.items():
        if name not in _OPERATOR_SET:
            os.environ[name] = value
    return {name: os.environ[name] for name in wanted}


def import_store_module() -> Any:
    """``mooncake.store``, or ``BackendUnavailableError`` saying what to install."""
    try:
        return importlib.import_module("mooncake.store")
    except ImportError as exc:
        raise BackendUnavailableError(
            f"the Mooncake client cannot be imported ({exc}); {INSTALL_HINT}"
        ) from exc


class Connection:
    """One ``MooncakeDistributedStore``, set up in the background and replaced on failure."""

    def __init__(
        self,
        config: MooncakeStoreConfig,
        name: str,
        lanes: HeaderLanes,
        l1: memoryview | None = None,
        on_closed_late: Callable[[], None] | None = None,
        on_left_unclosed: Callable[[str], None] | None = None,
        on_unclosed_closed: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self.name = name
        self.lanes = lanes
        #: the L1 arena, registered with each client so that payloads move straight
        #: between it and the pool (unregistered memory goes through Mooncake's own
        #: staging copy); None without an L1 (tests, tools)
        self.l1 = l1
        #: whether the last client set up has the L1 arena registered
        self.l1_registered = False
        self._module: Any = None
        self._store: Any = None
        self._lock = threading.Lock()
        self._connected = threading.Event()
        #: set once ``start`` need wait no longer: connected, or the set-up refused
        self._settled = threading.Event()
        #: while ``start`` waits: a set-up refusal then fails the start (``refusal``)
        self._starting = False
        self.refusal: SetupRefused | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_error = "the first set-up attempt has not ended yet"
        self.attempts = 0
        self.failures = 0
        #: calls of the adapter's threads using the client right now (see ``leased``)
        self._leases = 0
        self._idle = threading.Condition()
        #: the client a close left open under running calls: the last of them to end
        #: closes it (see ``close``); guarded by ``_idle``
        self._left_open: Any = None
        #: called once such a client has been closed (the adapter counts and logs it)
        self._on_closed_late = on_closed_late
        #: called with the reason when a client is left unclosed because the master or
        #: the metadata server does not answer (see ``_close_or_keep``)
        self._on_left_unclosed = on_left_unclosed
        #: called once a client left unclosed was closed after all (see ``_keep_until_answered``)
        self._on_unclosed_closed = on_unclosed_closed

    def start(self, wait_s: float) -> bool:
        """Import the client, start connecting; True if connected within ``wait_s``.

        ``ConfigError`` when Mooncake refuses the set-up meanwhile (``SetupRefused``): the
        server does not start with a config no attempt can serve, where it would retry
        for good as if the master did not answer."""
        self._module = import_store_module()
        # The server refused it in its pre-flight already; an adapter built otherwise (a
        # tool, a test) must not reach the set-up with it either.
        missing = missing_metadata_plugin(self._module, self.config.metadata_server)
        if missing is not None:
            raise ConfigError(f"{self.name}: metadata_server: {missing}")
        self._thread = threading.Thread(
            target=self._connect_loop, name=f"mooncake-{self.name}-connect", daemon=True
        )
        self._starting = True
        self._thread.start()
        self._settled.wait(wait_s)
        with self._lock:
            self._starting = False
            refusal = self.refusal
        if refusal is not None:
            raise ConfigError(f"{self.name}: {refusal}")
        return self.connected

    def _refuses_start(self, exc: Exception) -> bool:
        """True if ``exc`` ends the connection attempts by failing ``start`` (a refusal
        while it waits); later refusals are retried like any failure (the memory may
        free up), their cause in the log."""
        if not isinstance(exc, SetupRefused):
            return False
        with self._lock:
            if not self._starting:
                return False
            self.refusal = exc
        self._settled.set()
        return True

    @property
    def module(self) -> Any:
        """The imported ``mooncake.store`` module (after ``start``)."""
        return self._module

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def store(self) -> Any:
        """The connected client; ``MooncakeUnavailable`` while there is none."""
        with self._lock:
            store = self._store
        if store is None:
            raise MooncakeUnavailable(f"not connected to the Mooncake pool: {self.last_error}")
        return store

    @contextmanager
    def leased(self) -> Iterator[Any]:
        """The connected client (as ``store``) for one call of the adapter's threads:
        ``close`` waits for the call to end before closing the client under it (a load
        inside Mooncake writes into L1 until its own timeouts end it)."""
        # Counted before the client is taken: a close that took it away since fails
        # ``store()`` here, and one after waits for this call.
        with self._idle:
            self._leases += 1
        try:
            yield self.store()
        finally:
            with self._idle:
                self._leases -= 1
                left_open = None
                if not self._leases:
                    self._idle.notify_all()
                    left_open, self._left_open = self._left_open, None
            if left_open is not None:
                self._close_late(left_open)

    def _close_late(self, store: Any) -> None:
        """Close the client a close left open, now that the last call using it ended: on
        a thread of its own, as closing may retry for long against a master that is gone,
        and this is the thread of the call that just ended."""

        def close_and_report() -> None:
            if (
                self._close_or_keep(store, self.config.operation_timeout_s)
                and self._on_closed_late is not None
            ):
                self._on_closed_late()

        threading.Thread(
            target=close_and_report, name=f"mooncake-{self.name}-close-late", daemon=True
        ).start()

    def _connect_loop(self) -> None:
        pause = _RETRY_FIRST_S
        while not self._stop.is_set():
            self.attempts += 1
            try:
                store = self._setup()
            except Exception as exc:  # a set-up failure is retried, never raised
                self.failures += 1
                # A new cause is always shown (a master back up that refuses the segment).
                changed = str(exc) != self.last_error
                self.last_error = str(exc)
                if self._refuses_start(exc):
                    return
                noted = changed or self.failures == 10 or self.failures % 100 == 0
                log = logger.warning if noted else logger.debug
                log(
                    "%s: Mooncake set-up failed (attempt %d): %s; retrying in %.0fs",
                    self.name,
                    self.attempts,
                    exc,
                    pause,
                )
                if self._stop.wait(pause):
                    return
                pause = min(pause * 2, _RETRY_MAX_S)
                continue
            with self._lock:
                if self._stop.is_set():
                    _close_quietly(store)
                    return
                self._store = store
            self._connected.set()
            self._settled.set()
            logger.info(
                "%s: connected to the Mooncake master at %s (lending %d bytes to the pool)",
                self.name,
                self.config.master_server_address,
                self.config.segment_bytes,
            )
            return

    def _setup(self) -> Any:
        config = self.config
        diagnosis_s = min(config.operation_timeout_s, _DIAGNOSIS_TIMEOUT_S)
        # Mooncake's set-up holds the GIL throughout -- about 4.5 s against a master that
        # is down, every thread of the server stalled -- so it is tried only when both
        # services take a connection.
        unreachable = unreachable_service(config, diagnosis_s)
        if unreachable is not None:
            raise MooncakeError(f"set-up not tried: {unreachable}")
        # Not tried either under a name another client holds: Mooncake would refuse it, and
        # drop the holder's entry from the metadata server on the way.
        taken = segment_name_holder(config, diagnosis_s)
        if taken is not None:
            raise SetupRefused(taken)
        with _SETUP_LOCK:
            applied = apply_timeout_environment(config.operation_timeout_s)
            logger.debug(
                "%s: Mooncake set-up with %s", self.name, ", ".join(f"{k}={v}" for k, v in applied.items())
            )
            store = self._module.MooncakeDistributedStore()
            try:
                code = store.setup(
                    config.local_hostname,
                    config.metadata_server,
                    config.segment_bytes,
                    config.local_buffer_bytes,
                    config.protocol,
                    "",  # RDMA devices: none with TCP
                    config.master_server_address,
                )
            except MemoryError as exc:  # std::bad_alloc of the transfer buffer
                _close_quietly(store)
                raise SetupRefused(
                    f"local_buffer_size {config.local_buffer_size!r}: Mooncake cannot allocate a transfer "
                    f"buffer of {config.local_buffer_bytes} bytes ({exc}); give a smaller one"
                ) from exc
        if code == INVALID_PARAMS:
            # What the set-up answers when it cannot allocate the segment (Mooncake's log
            # says "Failed to allocate segment memory"): the config's, not the master's.
            _close_quietly(store)
            raise SetupRefused(
                f"global_segment_size {config.global_segment_size!r}: Mooncake refused its set-up "
                f"({describe(code)}), as it does when it cannot allocate a segment of "
                f"{config.segment_bytes} bytes on this host; lend less, or 0"
            )
        if code != 0:
            _close_quietly(store)
            # Mooncake answers -1 for every service it could not use: name the one.
            found = unanswered_services(config, diagnosis_s)
            raise MooncakeError(f"setup returned {describe(code)}: {found}")
        code = store.register_buffer(self.lanes.address, self.lanes.size)
        if code != 0:
            _close_quietly(store)
            raise MooncakeError(f"registering the header buffer returned {describe(code)}")
        self.l1_registered = False
        if self.l1 is not None and self.l1.nbytes:
            code = store.register_buffer(address_of(self.l1), self.l1.nbytes)
            self.l1_registered = code == 0
            if code != 0:
                # Still correct, only slower: Mooncake stages unregistered memory itself.
                logger.warning(
                    "%s: registering the L1 arena (%d bytes) with Mooncake returned %s; "
                    "payloads go through Mooncake's staging copy",
                    self.name,
                    self.l1.nbytes,
                    describe(code),
                )
        return store

    def close(self, timeout_s: float, calls_wait_s: float) -> int:
        """Stop connecting and close the client, waiting at most ``timeout_s``; the number
        of calls still using it after ``calls_wait_s`` (0: closed).

        The client is closed only once no call uses it (``leased``): closed under a load,
        the load would fail whatever it read.  Calls still running after ``calls_wait_s``
        leave it open -- never closed under them -- and the last of them to end closes
        it (``on_closed_late`` is called then); a call stuck forever keeps it open until
        the process ends.
        Closing unmounts this server's segment at the master and unregisters the client
        at the metadata server, holding the GIL throughout: when either does not answer
        within ``timeout_s`` the client is left unclosed instead (``_close_or_keep``).
        """
        self._stop.set()
        with self._lock:
            store, self._store = self._store, None
        self._connected.clear()
        if store is None:
            return 0
        with self._idle:
            self._idle.wait_for(lambda: not self._leases, calls_wait_s)
            running = self._leases
            if running:
                # Handed to the calls still running, in the same critical section as
                # the count: the last of them to end closes it (``leased``).  A call
                # starting from now on finds no client and is refused.
                self._left_open = store
                return running
        self._close_or_keep(store, timeout_s)
        return 0

    def _close_or_keep(self, store: Any, timeout_s: float) -> bool:
        """Close ``store`` if the master and the metadata server answer within
        ``timeout_s``; else leave it unclosed for the life of the process (reported to
        ``on_left_unclosed``).  True if it was closed.

        Mooncake's close unmounts the segment at the master and unregisters the client at
        the metadata server with a fixed 3 s HTTP timeout per request (three of them), and
        its binding holds the GIL all the while: no thread of the process runs meanwhile,
        so no deadline of ours can cut it short.  Its destructor does the same, so a
        client left unclosed is also never freed (``_keep_for_good``); a thread of its own
        closes it if both answer again soon (``_keep_until_answered``).
        """
        unanswered = self._unanswered_service(store, timeout_s)
        if unanswered is not None:
            _keep_for_good(store)
            logger.warning(
                "%s: %s did not answer within %gs: the Mooncake client is left unclosed (closing "
                "it would stall every thread of the process for Mooncake's fixed timeouts), closed "
                "if it answers within %.0fs; the master drops its segment when its lease expires",
                self.name,
                unanswered,
                timeout_s,
                _UNCLOSED_RETRY_FOR_S,
            )
            if self._on_left_unclosed is not None:
                self._on_left_unclosed(unanswered)
            self._keep_until_answered(store, timeout_s)
            return False
        _close_quietly(store)
        return True

    def _keep_until_answered(self, store: Any, timeout_s: float) -> None:
        """Hold a client left unclosed on a NON-daemon thread that closes it once the
        master and the metadata server answer again, for ``_UNCLOSED_RETRY_FOR_S`` at most.

        Non-daemon on purpose: Mooncake's exit handler tears down every client it made
        when the process exits, and against a service still hung that stalls the exit for
        its fixed timeouts (about 9 s).  A server's leave path ends the process at once
        (``os._exit``, which skips that handler) when a non-daemon thread is still running
        after the stop; this thread is that signal while the client is unclosed.  Any
        other process (a tool, a test) that reaches its normal exit is not kept waiting:
        the thread ends when the main thread has ended."""

        def close_when_answered() -> None:
            deadline = time.monotonic() + _UNCLOSED_RETRY_FOR_S
            pause = max(_RETRY_FIRST_S, timeout_s)
            main = threading.main_thread()
            while time.monotonic() + pause < deadline:
                main.join(pause)  # a pause, cut short by the process's exit
                if not main.is_alive():
                    logger.info("%s: the process exits with a Mooncake client left unclosed", self.name)
                    return
                # On this thread, not given up: a daemon thread inside Mooncake when the
                # process exits aborts it, and waiting here holds nobody.
                if self._unanswered_service(store, timeout_s, _master_answers_here) is None:
                    _close_quietly(store)
                    logger.info(
                        "%s: the Mooncake client left unclosed was closed: both services answer", self.name
                    )
                    if self._on_unclosed_closed is not None:
                        self._on_unclosed_closed()
                    return
            logger.warning(
                "%s: the Mooncake client left unclosed stays unclosed: the master or the metadata server "
                "did not answer for %.0fs (the process's exit tears it down, waiting on them)",
                self.name,
                _UNCLOSED_RETRY_FOR_S,
            )

        threading.Thread(
            target=close_when_answered, name=f"mooncake-{self.name}-unclosed-client", daemon=False
        ).start()

    def _unanswered_service(
        self, store: Any, timeout_s: float, master_answers: Callable[[Any, float, str], bool] | None = None
    ) -> str | None:
        """The service Mooncake's close talks to that neither answers nor refuses within
        ``timeout_s`` (a description), or None if both do.  The master is asked by
        ``master_answers`` (by default on a deadline pool, given up at the deadline)."""
        deadline = time.monotonic() + timeout_s
        answers = (master_answers or _master_answers)(store, timeout_s, self.name)
        if not answers:
            return f"the Mooncake master at {self.config.master_server_address}"
        metadata = self.config.metadata_server
        if not _metadata_server_answers(metadata, max(0.0, deadline - time.monotonic())):
            return f"the metadata server at {metadata}"
        return None


def _master_answers(store: Any, timeout_s: float, name: str) -> bool:
    """Whether an existence query of the master ends within ``timeout_s``, answered or
    refused (a master that is down refuses at once, and so does the unmount at close);
    one that timed out in Mooncake (its RPC timeout is ``timeout_s`` too) did not answer.
    Run on a deadline pool of its own (the binding releases the GIL for it), given up at
    the deadline: a process exiting waits for it as for the adapter's given-up calls."""
    pool = CallPool(f"{name}-close-probe", 1, exit_wait_s=timeout_s + RECONNECT_S)
    try:
        codes = pool.run("the master probe before close", timeout_s, _query_master, store, name)
    except CallTimeout:
        return False
    finally:
        pool.close()  # its thread ends once the query has
    return _RPC_TIMED_OUT not in codes


def _master_answers_here(store: Any, timeout_s: float, name: str) -> bool:
    """``_master_answers``'s verdict, the query made on the calling thread and waited for
    to its end (Mooncake's own timeouts, or its ~4 s reconnect to a killed master)."""
    started = time.monotonic()
    codes = _query_master(store, name)
    return time.monotonic() - started <= timeout_s and _RPC_TIMED_OUT not in codes


def _query_master(store: Any, name: str) -> list[int]:
    """The codes of an existence query of the probe name before ``name``'s close; none if
    it raised."""
    try:
        return list(store.batch_is_exist([_CLOSE_PROBE_NAME]))
    except Exception:
        logger.debug("%s: the master probe before close failed", name, exc_info=True)
        return []


def _metadata_server_answers(url: str, timeout_s: float) -> bool:
    """Whether an HTTP metadata server answers (any status) or refuses the connection
    within ``timeout_s`` -- what the teardown's requests then do as quickly; True for
    other kinds of metadata service, which this cannot probe."""
    if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
        return True
    if timeout_s <= 0:
        return False
    separator = "&" if "?" in url else "?"
    probe = f"{url}{separator}key={urllib.parse.quote(_CLOSE_PROBE_NAME)}"
    try:
        with urllib.request.urlopen(probe, timeout=timeout_s):
            return True
    except urllib.error.HTTPError:
        return True  # it answered (no such key)
    except TimeoutError:
        return False
    except urllib.error.URLError as exc:
        return not isinstance(exc.reason, TimeoutError)
    except (OSError, ValueError):
        return True  # failed at once: so will the teardown's requests


#: the name the probes before a close ask for (never stored)
_CLOSE_PROBE_NAME = "lmcache-tiers-close-probe"


def _keep_for_good(store: Any) -> None:
    """Never free ``store``: its destructor runs Mooncake's teardown (the same stall as
    its close) on whichever thread drops the last reference.  A reference taken at the C
    level is never given back, so it never runs.  Mooncake's own exit handler still tears
    down every client at process exit; nothing here can unregister a client from it (see
    ``Connection._keep_until_answered`` for how a server's exit skips it)."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(store))


def _close_quietly(store: Any) -> None:
    try:
        store.close()
    except Exception:
        logger.debug("closing a Mooncake client failed", exc_info=True)
