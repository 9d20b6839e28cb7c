"""The state machine of the circuit breaker (closed / open); :mod:`~lmcache_tiers.l2.circuit`
puts it in front of a backend.  It knows nothing about backends: callers report each
call's outcome and each probe's, and it opens, closes, counts and logs."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from lmcache_tiers.config import CircuitConfig

log = logging.getLogger("lmcache_tiers.l2")

__all__ = ["CallTimeout", "CircuitBreaker"]


class CallTimeout(TimeoutError):
    """A lookup or probe the backend did not answer within ``call_timeout_s``."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"no answer within call_timeout_s={timeout_s:g} s")


class CircuitBreaker:
    """The state machine (closed / open), thread-safe; knows nothing about backends."""

    def __init__(self, name: str, config: CircuitConfig, count: Callable[[str, int], None]) -> None:
        self.name = name
        self.threshold = config.failure_threshold
        self.probe_interval_s = config.probe_interval_s
        self._count = count
        self._lock = threading.Lock()
        self._open = False
        self._consecutive = 0
        self._opened_at = 0.0
        self._failed_probes = 0
        #: called (outside the lock) each time the circuit opens: starts the probing
        self.on_open: Callable[[], None] | None = None

    @property
    def is_open(self) -> bool:
        return self._open

    def succeeded(self) -> None:
        with self._lock:
            self._consecutive = 0

    def failed(self, what: str) -> None:
        """A call failed; ``what`` (method and error) goes into the log line on opening."""
        self._count("circuit_failures", 1)
        with self._lock:
            self._consecutive += 1
            if self._open or self._consecutive < self.threshold:
                return
            self._open = True
            self._opened_at = time.monotonic()
            self._failed_probes = 0
        self._count("circuit_opened", 1)
        log.warning(
            "%s: circuit opened after %d consecutive failed calls (last: %s); lookups miss, stores "
            "are skipped and loads fail until a probe (every %.1f s) finds the backend answering",
            self.name,
            self.threshold,
            what,
            self.probe_interval_s,
        )
        if self.on_open is not None:
            self.on_open()

    def probe_failed(self, exc: BaseException) -> None:
        with self._lock:
            self._failed_probes += 1
        self._count("circuit_probe_failures", 1)
        log.debug("%s: probe failed: %s: %s", self.name, type(exc).__name__, exc)

    def probe_succeeded(self) -> None:
        with self._lock:
            if not self._open:
                return
            self._open = False
            self._consecutive = 0
            open_for = time.monotonic() - self._opened_at
            failed_probes = self._failed_probes
        self._count("circuit_closed", 1)
        log.warning(
            "%s: circuit closed: the backend answered a probe after %.1f s open (%d failed probes); "
            "calls resume",
            self.name,
            open_for,
            failed_probes,
        )

    def gauges(self) -> dict[str, int]:
        with self._lock:
            return {"circuit_open": int(self._open), "circuit_consecutive_failures": self._consecutive}
