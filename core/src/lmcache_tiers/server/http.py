"""HTTP endpoint for operators: ``/metrics`` (Prometheus text), ``/healthz``, ``/status`` (JSON).

It runs on its own threads so a slow scraper never delays an RPC, and it only reads:
nothing here changes server state, and nothing takes a path from the request beyond
matching these three routes (``GET`` or ``HEAD``; any other method is answered 405, or
501 for one it has no handler for, such as TRACE; any other path 404).
``/metrics`` and ``/healthz`` carry counters and a health
word only, never a process id, segment name or path; ``/status`` carries all of those,
so when the endpoint listens beyond loopback it answers only requests that present the
server's auth token (``Authorization: Bearer <token>``).
"""

from __future__ import annotations

import hmac
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST

from lmcache_tiers.burst import BurstLog, PolicyFailureLog
from lmcache_tiers.strict_json import strict_json

logger = logging.getLogger(__name__)


#: how long a connection may wait to send its request: an idle one would hold its thread;
#: also how long it may take to send it whole (and be answered), however it trickles in
REQUEST_TIMEOUT_S = 30.0
#: the socket timeout of a connection, in deadlines: a backstop the deadline always beats
SOCKET_TIMEOUT_FACTOR = 2.0
#: failure reasons of the endpoint itself (counted through ``failed``, shown under failures)
REFUSED_STATUS = "http_status_refused"
ROUTE_FAILED = "http_route_failed"
TIMED_OUT = "http_connection_timed_out"
REFUSED_BUSY = "http_connection_refused_busy"
#: a request the endpoint could not take (bad syntax, header lines too long or too many, an
#: HTTP version or method it does not speak) or one using a method the routes do not allow
REFUSED_MALFORMED = "http_request_malformed"
REFUSED_METHOD = "http_method_not_allowed"
#: a request for a path that is none of the routes (a scraper configured with a wrong path)
NOT_FOUND = "http_path_not_found"
#: connections served at once: each holds a thread (and its deadline's timer) for up to
#: REQUEST_TIMEOUT_S, so a client opening them without end would take threads and file
#: descriptors from the whole server; those over the limit are closed at once, counted
MAX_CONNECTIONS = 32
#: connections taken a second in the long run, and at once after a quiet spell: each costs
#: a thread and parsing on the interpreter the RPC front ends share, so a client opening
#: them as fast as it can would slow every RPC; scrapers need a few a second.  Those past
#: the pace wait in the listen backlog for their turn, counted
MAX_CONNECTIONS_PER_S = 50.0
CONNECTION_BURST = 50
PACED = "http_connection_paced"
#: names of the endpoint's threads in a thread dump: one per connection served, and the
#: timer that cuts that connection at its deadline
CONNECTION_THREAD = "tiers-http-connection"
DEADLINE_THREAD = "tiers-http-deadline"

_ALLOWED = "GET, HEAD"

_refusals = BurstLog(logger, REFUSED_BUSY)
_bad_requests = BurstLog(logger, REFUSED_MALFORMED)
#: a client retrying /status with a wrong token would otherwise write a line per request
_status_refusals = BurstLog(logger, REFUSED_STATUS, level=logging.INFO)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    #: the standard library's connection threads are unnamed ("Thread-7 (process_request_
    #: thread)") and its tracking of them private: this server starts and joins its own
    block_on_close = False
    allow_reuse_address = True
    #: set by HttpEndpoint before it serves
    slots: threading.BoundedSemaphore
    refused: Callable[[], object]
    pace: _Pace

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._connections: set[threading.Thread] = set()
        #: the handlers of the connections being served, which the close ends
        self._handlers: set[Any] = set()
        self._closing = False
        self._connections_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        self.pace.wait(client_address[0])
        if not self.slots.acquire(blocking=False):
            self.refused()
            _refusals.warn(
                "busy",
                "HTTP connection from %s closed: %d connections are being served already",
                client_address[0],
                MAX_CONNECTIONS,
            )
            self.shutdown_request(request)
            return
        try:
            self._start_connection(request, client_address)
        except BaseException:
            self.slots.release()  # no thread took the connection
            raise

    def _start_connection(self, request: Any, client_address: Any) -> None:
        """Serve the connection on a thread named for a thread dump, as
        ``ThreadingMixIn.process_request`` would on an unnamed one."""
        thread = threading.Thread(
            target=self.process_request_thread,
            args=(request, client_address),
            name=CONNECTION_THREAD,
            daemon=True,
        )
        with self._connections_lock:
            self._connections.add(thread)
        try:
            thread.start()
        except BaseException:
            self._forget_connection(thread)
            raise

    def _forget_connection(self, thread: threading.Thread) -> None:
        with self._connections_lock:
            self._connections.discard(thread)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget_connection(threading.current_thread())
            self.slots.release()

    def serving(self, handler: Any) -> bool:
        """Track the handler of a connection being served until :meth:`served`; False once
        the close began (the handler then ends its connection itself)."""
        with self._connections_lock:
            if self._closing:
                return False
            self._handlers.add(handler)
            return True

    def served(self, handler: Any) -> None:
        with self._connections_lock:
            self._handlers.discard(handler)

    def server_close(self) -> None:
        """Close the socket, shut down the connections being served, then wait for their
        threads.  Waiting for their deadline (REQUEST_TIMEOUT_S) instead would let a client
        that keeps a connection open (idle, or sending its request slowly) hold the stop for
        that long -- past the few seconds a forced stop gets before it is taken for a stuck
        thread and the process is ended as a failed stop."""
        super().server_close()
        with self._connections_lock:
            self._closing = True
            serving = list(self._connections)
            handlers = list(self._handlers)
        for handler in handlers:
            handler.end_at_close()
        for thread in serving:
            thread.join()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A scraper that hung up (its scrape timeout) is one debug line; anything else is
        logged with its traceback -- never printed to stderr beside the log, as the
        standard library does."""
        error = sys.exc_info()[1]
        if isinstance(error, ConnectionError):
            logger.debug("HTTP client %s went away: %s", client_address, error)
        else:
            logger.exception("HTTP request from %s failed", client_address)


class _Pace:
    """Takes at most ``MAX_CONNECTIONS_PER_S`` connections a second in the long run,
    ``CONNECTION_BURST`` at once.  Only the accept loop calls it: waiting here holds back the
    next accept, so connections past the pace queue in the kernel, costing no thread."""

    def __init__(self, paced: Callable[[], object]) -> None:
        self._rate = MAX_CONNECTIONS_PER_S
        self._burst = float(CONNECTION_BURST)
        self._tokens = self._burst
        self._last = time.monotonic()
        self._paced = paced

    def wait(self, client: str) -> None:
        now = time.monotonic()
        self._tokens = min(self._burst, self._tokens + (now - self._last) * self._rate)
        self._last = now
        if self._tokens < 1.0:
            delay = (1.0 - self._tokens) / self._rate
            self._paced()
            _refusals.warn(
                PACED,
                "HTTP connections arrive faster than %g a second: the one from %s waited %.3fs",
                self._rate,
                client,
                delay,
            )
            time.sleep(delay)
            self._last = time.monotonic()
            self._tokens = 1.0
        self._tokens -= 1.0


class _Server6(_Server):
    address_family = socket.AF_INET6


class HttpEndpoint:
    """Serves the three read-only routes on ``host:port`` from a daemon thread."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        metrics: Callable[[], bytes],
        status: Callable[[], dict[str, Any]],
        health: Callable[[], tuple[bool, str]],
        status_token: str | None = None,
        failed: Callable[[str], object] | None = None,
    ) -> None:
        """``status_token``: when set, ``/status`` needs ``Authorization: Bearer <it>``.
        ``failed(reason)`` counts each refusal and each route that failed."""
        count = failed if failed is not None else (lambda reason: None)
        # this endpoint's own: a route failing on every scrape, or a client cut at every
        # deadline, must cost a line per burst, not one per request
        route_failures = PolicyFailureLog(logger, ROUTE_FAILED)
        timeouts = BurstLog(logger, TIMED_OUT, level=logging.INFO)
        routes: dict[str, Callable[[], tuple[int, str, bytes]]] = {
            "/metrics": lambda: (200, CONTENT_TYPE_LATEST, metrics()),
            "/status": lambda: (200, "application/json", strict_json(status()).encode()),
            "/healthz": lambda: _health_response(health()),
        }
        expected = f"Bearer {status_token}".encode() if status_token else None

        class Handler(BaseHTTPRequestHandler):
            server_version = "lmcache-tiers"
            # The socket's own timeout only backs up the deadline set in setup(), which
            # counts and logs the cut: one as short would race it and close an idle
            # connection with a debug line alone.
            timeout = REQUEST_TIMEOUT_S * SOCKET_TIMEOUT_FACTOR

            def setup(self) -> None:
                super().setup()
                # A socket timeout bounds each wait, not the exchange: a client sending a
                # byte now and then would keep this thread for good.  At the deadline the
                # connection is shut down, which ends any read or write of it.
                self._cut_lock = threading.Lock()
                self._done = self._was_cut = False
                self._cutoff = threading.Timer(REQUEST_TIMEOUT_S, self._cut)
                self._cutoff.name = DEADLINE_THREAD
                self._cutoff.daemon = True
                self._cutoff.start()
                if not _server_of(self).serving(self):
                    self.end_at_close()  # accepted before the close, set up after it

            def _shut(self) -> bool:
                """Shut the connection down, ending any read or write of it; False when it
                was done already."""
                with self._cut_lock:  # the socket is open until finish() has run
                    if self._done or self._was_cut:
                        return False
                    self._was_cut = True
                    try:
                        self.connection.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass  # the peer reset it already
                return True

            def end_at_close(self) -> None:
                """The endpoint stops: nothing more is read or answered (not a failure)."""
                if self._shut():
                    logger.debug("HTTP connection from %s closed: the endpoint stops", self.address_string())

            def _cut(self) -> None:
                if not self._shut():
                    return
                count(TIMED_OUT)
                timeouts.warn(
                    TIMED_OUT,
                    "HTTP connection from %s cut: not done within %gs",
                    self.address_string(),
                    REQUEST_TIMEOUT_S,
                )

            def finish(self) -> None:
                with self._cut_lock:
                    self._done = True
                self._cutoff.cancel()
                _server_of(self).served(self)
                super().finish()

            def do_HEAD(self) -> None:
                self._serve(send_body=False)

            def do_GET(self) -> None:
                self._serve(send_body=True)

            def _refuse_method(self) -> None:
                """Every route only reads: other methods get 405 (404 off the routes)."""
                if self._was_cut:
                    return
                if self.path.split("?", 1)[0] not in routes:
                    self._not_found(send_body=True)
                    return
                count(REFUSED_METHOD)
                _bad_requests.warn(
                    "method",
                    "HTTP %s %.80r from %s refused: not allowed",
                    self.command,
                    self.path,
                    self.address_string(),
                )
                self._reply(
                    405,
                    "text/plain; charset=utf-8",
                    f"{self.command} not allowed: the routes answer {_ALLOWED}\n".encode(),
                    {"Allow": _ALLOWED},
                )

            do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse_method

            def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
                """The standard library answers a request it could not parse (400, 414, 431,
                505) or whose method no ``do_*`` serves (501) here: counted and logged once
                per burst, not only a debug line.  A connection cut (at its deadline, or by
                the stop) is answered nothing: what it had sent of its request when it was
                cut is no request of its own, and the cut is counted once, as itself."""
                if self._was_cut:
                    return
                count(REFUSED_MALFORMED)
                _bad_requests.warn(
                    str(code),
                    "HTTP request from %s refused with %d: %.120r",
                    self.address_string(),
                    code,
                    message or self.responses.get(code, ("?",))[0],
                )
                super().send_error(code, message, explain)

            def _not_found(self, *, send_body: bool) -> None:
                count(NOT_FOUND)
                _bad_requests.warn(
                    NOT_FOUND,
                    "HTTP %s %.80r from %s: no such route (the routes are /metrics, /status, /healthz)",
                    self.command,
                    self.path,
                    self.address_string(),
                )
                body = b"not found: try /metrics, /status, /healthz\n"
                self._reply(404, "text/plain; charset=utf-8", body, send_body=send_body)

            def _serve(self, *, send_body: bool) -> None:
                if self._was_cut:
                    return  # what arrived was cut short at the deadline: nobody to answer
                path = self.path.split("?", 1)[0]
                route = routes.get(path)
                if route is None:
                    self._not_found(send_body=send_body)
                    return
                if path == "/status" and expected is not None:
                    # The header parser decoded the header's bytes as latin-1: encoding it
                    # back gives the bytes the client sent, a token's UTF-8 beyond ASCII.
                    offered = self.headers.get("Authorization", "").encode("latin-1", "replace")
                    if not hmac.compare_digest(offered, expected):
                        count(REFUSED_STATUS)
                        _status_refusals.warn(
                            REFUSED_STATUS,
                            "HTTP /status refused to %s: missing or wrong token",
                            self.address_string(),
                        )
                        self._reply(
                            401,
                            "text/plain; charset=utf-8",
                            b"/status needs the server's auth token: Authorization: Bearer <token>\n",
                            {"WWW-Authenticate": 'Bearer realm="lmcache-tiers"'},
                            send_body=send_body,
                        )
                        return
                try:
                    code, content_type, body = route()
                except Exception:
                    count(ROUTE_FAILED)
                    route_failures.failed("HTTP %s failed", path)
                    code, content_type, body = 500, "text/plain; charset=utf-8", b"internal error\n"
                self._reply(code, content_type, body, send_body=send_body)

            def _reply(
                self,
                code: int,
                content_type: str,
                body: bytes,
                extra: dict[str, str] | None = None,
                *,
                send_body: bool = True,
            ) -> None:
                """``send_body`` False answers a HEAD: the same headers, no body."""
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                for name, value in (extra or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                if send_body:
                    self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                logger.debug("http %s - %s", self.address_string(), format % args)

        host = host.strip("[]")
        if host == "*":
            # every address, as a front end's "*" and the start-up pre-flight's probe read it
            host = "0.0.0.0"
        self._server = (_Server6 if ":" in host else _Server)((host, port), Handler)
        self._server.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._server.refused = lambda: count(REFUSED_BUSY)
        self._server.pace = _Pace(lambda: count(PACED))
        self._thread = threading.Thread(target=self._serve, name="tiers-http", daemon=True)

    @property
    def url(self) -> str:
        address = self._server.server_address
        host = address[0].decode() if isinstance(address[0], bytes) else str(address[0])
        port = address[1]
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{port}"

    #: how often the serving loop looks whether ``stop`` asked it to end (a stop waits up
    #: to this long for it): with socketserver's 0.5 s every stop of a server waited a
    #: quarter of a second on average; an idle endpoint now wakes ten times a second
    SHUTDOWN_POLL_S = 0.1

    def start(self) -> None:
        self._thread.start()

    def _serve(self) -> None:
        self._server.serve_forever(poll_interval=self.SHUTDOWN_POLL_S)

    def stop(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout=5)
        self._server.server_close()


def _server_of(handler: BaseHTTPRequestHandler) -> _Server:
    """The endpoint's server that a connection's handler was made by."""
    server = handler.server
    assert isinstance(server, _Server)
    return server


def _health_response(state: tuple[bool, str]) -> tuple[int, str, bytes]:
    healthy, detail = state
    return (200 if healthy else 503), "text/plain; charset=utf-8", (detail + "\n").encode()
