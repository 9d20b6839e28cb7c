"""The ``redis`` backend: one Redis string per object, core's record -- its header, then
its payload (records.py says why a string, not a hash).

``GETRANGE`` of the value's first bytes answers a lookup from the header (sizes, key,
serde chain, all verified by its crc), and ``STRLEN`` in the same trip says the value is
as long as header and payload together: a crc-valid header describing another payload (a
buggy writer's) is damage, never a size to account; ``GET`` loads: the header is checked,
and the payload's length against the header and the caller's buffer, before the payload
is read; the object is reported loaded only once every byte matched the header's
checksum.  On a standalone store lookups and loads read their replies themselves
(direct.py, replies.py): the payload goes from the socket into the caller's buffer,
hashed piece by piece as it lands; stores are written there too, each checksum taken
while the store reads a payload already sent (writes.py).  In cluster mode they go
through redis-py's cluster pipeline, which follows slot moves: a store joins header and
payload into one value, and a load copies the verified payload out of the reply.

Why plain methods on worker threads (not ``redis.asyncio``): on 256 x 1 MiB the sync client
with pipelines stored and loaded ~1.5-2x faster than the asyncio client on this project's
2-core machine (asyncio's stream reader copies large replies once more and its event loop
competes with the server for the cores); see docs/adapters/redis.md.

Batches go out as pipelines of at most ``pipeline_max_bytes`` of payload, so a large load
holds a bounded number of replies at once (in the store's output buffer, or in reply
buffers here in cluster mode).  A connection error or timeout fails the
whole call (an exception: core counts it and the circuit breaker sees it) -- but a store
or delete whose earlier trips were done reports those keys done and the rest failed, and
in a cluster a trip some nodes answered fails only the keys of the node that failed: such
a call raises ``PartialFailure`` with its per-key answer, so core accounts the keys done
and the circuit breaker still sees the failure (a node that answers nothing would
otherwise cost every later batch its timeout, unseen).  The probe (``ping``) asks every
primary of a cluster.  A delete reads each header first and removes, by a script that
checks the header is still the one read (called by its digest, EVALSHA; sent whole only
to a node that answers NOSCRIPT), only this server's records: another key's intact
record and a newer format's are kept, as lookups keep them.  A per-object
error reply (WRONGTYPE for a foreign key, OOM from a full store) fails that object only,
counted and logged; one by which the store refuses every command of a kind (CLUSTERDOWN,
READONLY, MASTERDOWN, BUSY, LOADING, NOREPLICAS, MISCONF) fails the call -- and in a lookup or listing,
where any error reply but WRONGTYPE fails the call: "absent" would make core release
the bytes of an object still there.
So does any client error redis-py's cluster pipeline leaves in such a call's reply (a
redirection loop's ClusterError): the call fails, named by that error.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any, Literal

from redis import Redis, RedisCluster
from redis.exceptions import (
    AuthenticationError,
    ClusterDownError,
    NoPermissionError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    ResponseError,
    SlotNotCoveredError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from lmcache_plugin_redis.client import (
    build_client,
    certificate_refusal,
    describe,
    ignored_nodes,
    plain_text_node,
    tls_only_node,
)
from lmcache_plugin_redis.config import RedisConfig
from lmcache_plugin_redis.direct import DirectConnections, Send, pack_command
from lmcache_plugin_redis.limits import default_limits, read_limits
from lmcache_plugin_redis.records import (
    HEAD_READ,
    NO_GUARD,
    REMOVE_IF_UNCHANGED,
    REMOVE_IF_UNCHANGED_SHA,
    PayloadGuard,
    digest_guard,
    length_guard,
    payload_mismatch,
    split_head,
)
from lmcache_plugin_redis.replies import ReplyReader
from lmcache_plugin_redis.writes import RecordHeaders, RecordTrip
from lmcache_tiers.plugin import (
    PREFIX_SIZE,
    BackendContext,
    ConfigError,
    DeleteMarks,
    KeptByDelete,
    ObjectKey,
    ObjectSize,
    PartialFailure,
    PayloadVerifier,
    RecordError,
    RecordHeader,
    RecordVerdict,
    copy_into,
    key_to_name,
    name_to_key,
    record_verdict,
    verify_payload,
)

log = logging.getLogger("lmcache_tiers.l2.redis")

#: Redis keys may be long: every valid key gets its readable (decodable) name
NAME_LIMIT = 1 << 14
#: keys asked about per pipelined round trip in lookups, deletes and listings
KEYS_PER_TRIP = 512
_GIB = 1 << 30
#: reply errors that mean the store (or the way to it) failed, not one object
_CALL_FAILURES = (RedisConnectionError, RedisTimeoutError)
#: error replies by which the whole store (or cluster node) refuses every command of a
#: kind, whatever the key: the cluster is down (CLUSTERDOWN), a replica refuses writes
#: (READONLY) or, its primary gone, reads (MASTERDOWN), a script blocks it (BUSY), it
#: loads its data (LOADING), it lacks the replicas ``min-replicas-to-write`` asks for
#: (NOREPLICAS) or its last snapshot failed (MISCONF: writes stop).  redis-py parses
#: some into classes (dropping the code from the text); the direct reader (replies.py)
#: leaves the code.  OOM is not one of them: a
#: full store still serves lookups, loads and deletes (which free it), so only the
#: refused stores fail, counted as refused.
_STORE_REFUSALS = (ClusterDownError, ReadOnlyError)
_STORE_REFUSAL_CODES = (
    "CLUSTERDOWN ",
    "READONLY ",
    "MASTERDOWN ",
    "BUSY ",
    "LOADING ",
    "NOREPLICAS ",
    "MISCONF ",
)
#: what is wrong with one loaded object: its error reply, the head of its value judged,
#: why it is damaged and the value judged (to remove only that), or (a miss that is kept)
#: how to count and log it
Problem = ResponseError | tuple[bytes, RecordError, PayloadGuard] | Callable[[], None]


#: what ``_judged_header`` answers for an intact record of another serde chain
OTHER_CHAIN = "another serde chain"


def refuses_everything(reply: Any) -> bool:
    """Whether an error reply is the store's refusal of every such command, not an
    answer about one object: the call fails (core counts it, the circuit breaker sees it)."""
    if isinstance(reply, _STORE_REFUSALS):
        return True
    return isinstance(reply, ResponseError) and str(reply).startswith(_STORE_REFUSAL_CODES)


def _denied(reply: Any) -> bool:
    """Whether a reply is the ACL's refusal (NOPERM): parsed by redis-py, or read by the
    direct reader (which leaves the code in the text)."""
    if isinstance(reply, NoPermissionError):
        return True
    return isinstance(reply, ResponseError) and str(reply).startswith("NOPERM")


def per_object_error(reply: Any) -> bool:
    """An error reply about one object (WRONGTYPE, NOPERM for its name, OOM ...)."""
    return isinstance(reply, ResponseError) and not refuses_everything(reply)


#: the key name the start-up permission check queues commands on (never written)
PERMISSION_PROBE = "permission-check"


def permission_refusals(client: Redis, name: str) -> tuple[list[str], list[str]]:
    """The store's ACL refusals (NOPERM ...) of the commands the adapter sends, and its
    other refusals (READONLY on a replica, LOADING, OOM ...: no verdict on permissions),
    each queued in a MULTI on ``name`` and the transaction discarded: nothing runs,
    nothing is written."""
    commands: list[tuple[Any, ...]] = [
        ("SET", name, b""),
        ("GET", name),
        ("GETRANGE", name, 0, HEAD_READ - 1),
        ("SCAN", 0, "MATCH", glob_escape(name), "COUNT", 1),
        ("EVALSHA", REMOVE_IF_UNCHANGED_SHA, 1, name, b""),
        ("EVAL", REMOVE_IF_UNCHANGED, 1, name, b""),
        ("UNLINK", name),
    ]
    connection = client.connection_pool.get_connection()
    refusals: list[str] = []
    unchecked: list[str] = []
    try:
        connection.send_command("MULTI")
        connection.read_response()
        for command in commands:
            connection.send_command(*command)
            try:
                connection.read_response()
            except NoPermissionError as exc:
                refusals.append(f"{command[0]}: {exc}")
            except ResponseError as exc:  # the store's state, not the user's rights
                unchecked.append(f"{command[0]}: {exc}")
        connection.send_command("DISCARD")
        connection.read_response()
    except BaseException:
        connection.disconnect()  # a transaction may be left open on it
        raise
    finally:
        client.connection_pool.release(connection)
    return refusals, unchecked


def _unanswered_check(exc: Exception) -> str:
    """Why a node gave the permission check no verdict, by its cause: an error reply (an
    ACL denying MULTI or DISCARD themselves, a store refusing transactions) is the node
    answering, and an operator should look at its ACL, not at the network."""
    cause = "refused the check's commands" if isinstance(exc, ResponseError) else "did not answer"
    return f"{cause} ({type(exc).__name__}: {exc})"


#: seconds between two permission checks calls make of primaries not checked yet: one that
#: does not answer costs the call the check's timeout (the circuit's probe checks each time)
OWED_CHECK_INTERVAL_S = 1.0
#: first and longest pause before a call checks again a cluster primary that did not
#: answer its check: one gone for good would otherwise cost a call its timeout each
#: ``OWED_CHECK_INTERVAL_S`` (the circuit's probe checks it whatever the pause: it just
#: answered the probe's PING)
NODE_CHECK_PAUSE_FIRST_S = 2.0
NODE_CHECK_PAUSE_MAX_S = 60.0


class PermissionsDenied(RuntimeError):
    """A primary first checked after start-up denies the user a command the adapter sends:
    the adapter's calls fail (the circuit breaker opens) until a probe finds it allowed."""


#: how many probe names a cluster's permission check tries to find one per primary: a
#: name's slot is spread evenly, so a few dozen cover any real cluster's primaries
_PROBE_NAME_TRIES = 1 << 16


def primary_names(client: RedisCluster) -> set[str]:
    """The names (host:port) of the primaries in the client's slot map (no I/O)."""
    return {node.name for node in client.get_primaries()}


def cluster_probe_names(client: RedisCluster, base: str) -> dict[str, str]:
    """A name under ``base`` per primary (by node name) whose slot that primary serves,
    as the client's slot map has it."""
    primaries = primary_names(client)
    names: dict[str, str] = {}
    for number in range(_PROBE_NAME_TRIES):
        if len(names) == len(primaries):
            break
        name = f"{base}-{number}"
        names.setdefault(client.get_node_from_key(name).name, name)
    return names


#: the error Redis and Valkey answer a string over ``proto-max-bulk-len`` with, just
#: before they close the connection (their other protocol errors answer requests the
#: adapter never sends)
BULK_OVER_LIMIT_ERROR = "Protocol error: invalid bulk length"


def _dropped_connection(reply: Any) -> bool:
    """Whether a reply is what a value over the store's limits gets: the connection
    closed, or the error Redis answers just before closing it (which redis-py's cluster
    pipeline hands over as that command's reply)."""
    if isinstance(reply, RedisConnectionError):
        return True
    # redis-py drops the error code from the text; the direct reader (replies.py) keeps it
    return isinstance(reply, ResponseError) and str(reply).removeprefix("ERR ").startswith(
        BULK_OVER_LIMIT_ERROR
    )


def _dropped_indices(batch: list[int], replies: list[Any] | Exception) -> list[int]:
    """The objects of a store trip whose connection (the trip's, or a cluster node's)
    was dropped."""
    if isinstance(replies, Exception):
        return batch if _dropped_connection(replies) else []
    return [index for index, reply in zip(batch, replies, strict=True) if _dropped_connection(reply)]


def _first_failing_trip(number: int, stored: list[bool]) -> int:
    """The trip number a failure is reported as: trip 0 failing fails the whole call,
    right only while nothing of the batch is stored (see ``_trip_failed``)."""
    return number if number > 0 or not any(stored) else 1


def glob_escape(text: str) -> str:
    """``text`` as a literal in a SCAN MATCH pattern."""
    return "".join("\\" + char if char in "*?[]\\" else char for char in text)


#: ``pack_command(b"GETRANGE", name, b"0", b"<HEAD_READ - 1>") + pack_command(b"STRLEN",
#: name)`` as one format: a lookup packs two commands per key, and the format costs a third
#: of that
_LOOKUP_COMMANDS = (
    b"*4\r\n$8\r\nGETRANGE\r\n$%%d\r\n%%s\r\n$1\r\n0\r\n$%d\r\n%d\r\n"
    b"*2\r\n$6\r\nSTRLEN\r\n$%%d\r\n%%s\r\n" % (len(str(HEAD_READ - 1)), HEAD_READ - 1)
)


def lookup_commands(name: bytes) -> bytes:
    """A lookup's commands for ``name``, packed: its value's head, its value's length."""
    return _LOOKUP_COMMANDS % (len(name), name, len(name), name)


def trips(sizes: Sequence[int], max_bytes: int) -> Iterator[range]:
    """Consecutive index ranges of at most ``max_bytes`` (one item at least) and
    ``KEYS_PER_TRIP`` items each."""
    start, total = 0, 0
    for index, size in enumerate(sizes):
        if index > start and (total + size > max_bytes or index - start >= KEYS_PER_TRIP):
            yield range(start, index)
            start, total = index, 0
        total += size
    if start < len(sizes):
        yield range(start, len(sizes))


def _pools_of(client: Redis | RedisCluster) -> list[Any]:
    """The connection pools behind a client: its own, or each known cluster node's."""
    if isinstance(client, Redis):
        return [client.connection_pool]
    manager = client.nodes_manager
    nodes = {id(node): node for node in (*manager.nodes_cache.values(), *manager.startup_nodes.values())}
    return [
        node.redis_connection.connection_pool for node in nodes.values() if node.redis_connection is not None
    ]


class _LimitsLowered:
    """A store trip's connection was dropped on an object over the store's limits as
    read again: the objects ``unsent`` are sent again, trips numbered from
    ``first_trip``; ``failure``: the first failed node's error in the trips before."""

    __slots__ = ("failure", "first_trip", "unsent")

    def __init__(self, unsent: Sequence[int], first_trip: int, failure: Exception | None) -> None:
        self.unsent = unsent
        self.first_trip = first_trip
        self.failure = failure


class RedisBackend:
    """Objects in Redis or Valkey; see the module docstring for the layout."""

    remote = True

    def __init__(self, config: RedisConfig, context: BackendContext) -> None:
        self.config = config
        self.context = context
        self.concurrency = config.num_workers
        self.prefix = config.object_prefix()
        self.target = describe(config)
        self._capacity = int(config.max_capacity_gb * _GIB) or None
        # A cluster client needs an answering node to be built: until one answers, each
        # call tries again (and fails, which the circuit breaker counts).
        self._lock = threading.Lock()
        #: set by close: no connection of the client connects again (client.py)
        self._closing = threading.Event()
        self._client: Redis | RedisCluster | None = None
        #: lookups and loads of a standalone store read their replies themselves (direct.py)
        self._direct: DirectConnections | None = None
        #: kept records a delete judged, so the lookup core makes next counts none twice
        self._deletes = KeptByDelete(context)
        #: keys a delete found holding something else (counted): not counted again by the
        #: lookup core makes right after the delete (``KeptByDelete`` does so for records)
        self._foreign_by_delete: DeleteMarks[ObjectKey] = DeleteMarks(
            context, "foreign_delete_marks_forgotten", "their next lookup counts them again (foreign_objects)"
        )
        # The permission check of start-up reaches only the nodes that answer then; the
        # others are checked when they first answer (``_check_owed_permissions``).
        #: held by a check across its I/O; calls never wait for it (``_check_owed_permissions``)
        self._permission_lock = threading.Lock()
        #: held only to claim the next owed check and to change the verdict, never across I/O
        self._verdict_lock = threading.Lock()
        #: primaries (by node name; the target for a single store) that gave a verdict
        self._checked_nodes: set[str] = set()
        self._permissions_owed = True
        self._next_owed_check = 0.0
        #: the denial the last check found, refusing every call until a probe clears it
        self._denied: str | None = None
        #: checks made (numbered under ``_permission_lock``), and the number of the one
        #: whose verdict ``_denied`` holds: checks overlap (a probe's and a call's), and
        #: an older verdict recorded after a fresher one is stale (``_set_denial``)
        self._checks_made = 0
        self._verdict_of_check = 0
        #: what checks after start-up could not check, already said in a warning
        self._unchecked_said: set[str] = set()
        #: cluster primaries that did not answer their check: (when a call may check it
        #: again, the pause after the next failure); guarded by ``_permission_lock``
        self._node_check_pauses: dict[str, tuple[float, float]] = {}
        #: cluster primaries whose last verdict denied, with their refusals; guarded by
        #: ``_permission_lock``
        self._denying_nodes: dict[str, list[str]] = {}
        #: the store's ``proto-max-bulk-len`` and ``client-query-buffer-limit``
        #: (``_read_bulk_limit``; the lowest of a cluster's primaries), Redis's defaults
        #: until read
        self._limits = default_limits()
        #: whether the last read of the limits found a node refusing CONFIG GET (its
        #: limits taken at Redis's defaults): said and counted when that starts
        self._limits_assumed = False
        self._limits_lock = threading.Lock()
        if not config.cluster_mode:
            self._connect()

    @property
    def client(self) -> Redis | RedisCluster:
        return self._client if self._client is not None else self._connect()

    def _connect(self) -> Redis | RedisCluster:
        with self._lock:
            if self._client is None:
                client = build_client(self.config, self._closing)
                if isinstance(client, Redis):
                    self._direct = DirectConnections(client)
                self._client = client
            return self._client

    # -- names and replies ----------------------------------------------------------------------

    def name_of(self, key: ObjectKey) -> str:
        return self.prefix + key_to_name(key, NAME_LIMIT)

    def _pipeline(self) -> Any:
        if isinstance(self.client, RedisCluster):
            return self.client.pipeline()
        return self.client.pipeline(transaction=False)

    def _queue_lookup(self, pipe: Any, name: str | bytes) -> None:
        """Queue ``GETRANGE name 0 <HEAD_READ - 1>`` and ``STRLEN name`` (a lookup's or a
        listing's pair).
        In a cluster both go to the node the slot map names for ``name``, found once:
        redis-py's pipeline would otherwise route each command by its key again (its
        policy resolved, its key hashed) -- a third of the CPU of a lookup.
        A node that no longer serves the slot answers MOVED, and redis-py sends that
        command again routed by its key (a single named node is not kept for the retry);
        a slot the map does not cover is left to redis-py's own routing, which heals it."""
        options: dict[str, Any] = {}
        client = self.client
        if isinstance(client, RedisCluster):
            with contextlib.suppress(SlotNotCoveredError):
                options["target_nodes"] = client.get_node_from_key(name)
        pipe.execute_command("GETRANGE", name, 0, HEAD_READ - 1, **options)
        pipe.execute_command("STRLEN", name, **options)

    def _execute(self, pipe: Any, *, per_key: bool = False) -> list[Any]:
        """Replies of a pipeline; raises when the store, not one object, failed.

        ``per_key``: a cluster pipeline answers each command of a node that failed
        (dropped, timed out) with that error while the other nodes' commands were done;
        those replies are returned for the caller to fail their keys alone, and only a
        pipeline no command of which got through raises.  Without ``per_key`` (lookups,
        loads, listings) any client error in a reply fails the call: its object may well
        be there, so "absent" would be wrong -- and the call's log line names that error."""
        replies: list[Any] = pipe.execute(raise_on_error=False)
        if not per_key:
            client_errors = [
                reply for reply in replies if isinstance(reply, Exception) and not per_object_error(reply)
            ]
            if client_errors:
                raise client_errors[0]
            return replies
        failures = [
            reply for reply in replies if isinstance(reply, _CALL_FAILURES) or refuses_everything(reply)
        ]
        if failures and len(failures) == len(replies):
            raise failures[0]
        return replies

    def _trip(self, pipe: Any, number: int, what: str, left: int) -> list[Any] | Exception:
        """Replies of trip ``number`` of a batch, ``left`` keys from its end; the error when
        a trip after the first failed (counted, logged): the earlier trips' keys are done
        (stored, removed), and the call reports them so (``_partly_done``) -- core would
        otherwise never account them, or keep accounting keys already gone.  Replies of a
        failed cluster node are left in the list (``_execute``): their keys fail alone.
        Keys the store answered with a refusal of every write (READONLY, NOREPLICAS ...)
        were refused, not lost on the way: ``<what>_refused_by_server``, not
        ``<what>_request_failures``."""
        try:
            return self._execute(pipe, per_key=True)
        except (RedisError, RedisClusterException) as exc:  # the latter: no cluster node answered
            return self._trip_failed(exc, number, what, left)

    def _trip_failed(self, exc: Exception, number: int, what: str, left: int) -> Exception:
        """``exc`` raised when trip ``number`` is the batch's first (the call fails
        whole), else counted, logged and returned (see ``_trip``)."""
        if number == 0:
            raise exc
        refused = refuses_everything(exc)
        self.context.count(f"{what}_refused_by_server" if refused else f"{what}_request_failures", left)
        self.context.warn(
            f"trip:{what}",
            "%s of %d keys %s (the batch's earlier ones were done): %s",
            what,
            left,
            "refused by the store" if refused else "failed",
            exc,
        )
        return exc

    @staticmethod
    def _partly_done(what: str, done: list[bool], failure: Exception | None) -> list[bool]:
        """``done``, or -- when part of the batch failed for the store's sake (a trip, a
        cluster node) -- raised as the answer of a failed call, for the circuit breaker to
        see (a returned answer would hide the failure)."""
        if failure is None:
            return done
        raise PartialFailure(
            done,
            f"{what} of {done.count(False)} of {len(done)} keys failed ({type(failure).__name__}: {failure})",
        ) from failure

    def _request_failed(self, what: str, key: ObjectKey, error: Exception) -> None:
        """A key whose command a failed cluster node never answered (or redis-py left
        another client error for, e.g. a redirection loop's ClusterError), in a trip whose
        other commands were done: that key fails (done or not, it cannot be told), counted.
        A node that answered with a refusal of every write (READONLY, NOREPLICAS ...)
        refused the key: ``<what>_refused_by_server``, as for a refused later trip."""
        if refuses_everything(error):
            self.context.count(f"{what}_refused_by_server")
            self.context.warn(
                f"node_refused:{what}",
                "%s %s refused by its cluster node, the rest of its trip was done: %s",
                what,
                key.file_stem(),
                error,
            )
            return
        self.context.count(f"{what}_request_failures")
        self.context.warn(
            f"node:{what}",
            "%s %s failed, the rest of its trip was done (a cluster node failed): %s",
            what,
            key.file_stem(),
            error,
        )

    def _reply_error(self, what: str, key: ObjectKey, error: Exception) -> None:
        text = str(error)
        if text.startswith("WRONGTYPE"):
            if not self._count_foreign(what, key):
                return
            self.context.count("foreign_objects")
            self.context.warn(
                "foreign",
                "%s %s: the key holds another type than a record's string (%s) -- a hash is a "
                "record of the layout before this release, replaced when the key is stored "
                "again; a miss",
                what,
                key.file_stem(),
                text,
            )
        elif isinstance(error, OutOfMemoryError) or text.startswith("OOM"):
            self.context.count("store_refused_by_server")
            self.context.warn("oom", "%s not stored: the store is full (%s)", key.file_stem(), text)
        else:
            self.context.count(f"{what}_reply_errors")
            self.context.warn(f"reply:{what}", "%s %s failed: %s", what, key.file_stem(), text)

    def _count_foreign(self, what: str, key: ObjectKey) -> bool:
        """Whether something else found under ``key``'s name is counted (and logged) now:
        always by a delete, which remembers it; not by the next lookup or load, which
        finds what that delete counted (a store or listing counts it all the same)."""
        if what == "delete":
            self._foreign_by_delete.add(key)
            return True
        if what not in ("lookup", "load") or not self._foreign_by_delete:  # the latter: rare
            return True
        return not self._foreign_by_delete.take(key)  # two lookups skip the count once

    # -- lifecycle ------------------------------------------------------------------------------

    def open(self) -> None:
        self._warn_of_ignored_nodes()
        try:
            self.client.ping()
        except NoPermissionError as exc:
            raise ConfigError(f"{self.context.name}: the Redis user may not run PING ({exc})") from None
        except Exception as exc:  # RedisError, or RedisClusterException when no seed answers
            # redis-py's cluster client raises its own exception, caused by the seed's
            rejected = exc if isinstance(exc, AuthenticationError) else exc.__cause__
            if isinstance(rejected, AuthenticationError):
                # The store answered: every call would fail on these credentials until its
                # users or this config change, as with a command its ACL denies (refused below).
                raise ConfigError(
                    f"{self.context.name}: {self.target} refused the credentials ({rejected}): "
                    "check username and password (or the url's)"
                ) from None
            if isinstance(exc, ResponseError) and str(exc).startswith("DB index is out of range"):
                # Answered too, by a store with fewer databases: SELECT fails every connection.
                pool = getattr(self.client, "connection_pool", None)
                db = pool.connection_kwargs.get("db") if pool is not None else self.config.database_id
                raise ConfigError(
                    f"{self.context.name}: {self.target} has no database {db} ({exc}): "
                    "give one below the store's `databases` setting"
                ) from None
            plain = plain_text_node(self.config)
            if plain is not None:
                # It answered, in plain text: every TLS connection would time out the same
                # way until this config or the store changes.
                raise ConfigError(
                    f"{self.context.name}: {self.target}: {plain} speaks no TLS (it answered a "
                    "plain-text PING), and the adapter connects with TLS (rediss://, or "
                    "tls_enable): use redis://, or turn TLS on in the store"
                ) from None
            tls_only = tls_only_node(self.config)
            if tls_only is not None:
                raise ConfigError(
                    f"{self.context.name}: {self.target}: {tls_only} speaks TLS only (it completed "
                    "a TLS handshake), and the adapter connects without: use rediss:// (or "
                    "tls_enable)"
                ) from None
            untrusted = certificate_refusal(exc)
            if untrusted is not None:
                raise ConfigError(
                    f"{self.context.name}: {self.target}: the store's TLS certificate is not "
                    f"trusted ({untrusted}): give its CA (?ssl_ca_certs=<file> in the url), or "
                    "check the host name the url names"
                ) from None
            # Not fatal: the circuit breaker keeps probing and the adapter heals when it answers.
            log.warning(
                "%s: %s does not answer yet (%s: %s)", self.context.name, self.target, type(exc).__name__, exc
            )
            return
        self._read_bulk_limit()
        try:
            self._refuse_missing_permissions(self.client)
        except (RedisError, RedisClusterException) as exc:  # the store went away, or refuses MULTI
            log.warning(
                "%s: could not check the Redis user's permissions (%s: %s)",
                self.context.name,
                type(exc).__name__,
                exc,
            )
        log.info("%s: connected to %s, objects named %r + key", self.context.name, self.target, self.prefix)

    def _read_bulk_limit(self) -> None:
        """Read the store's ``proto-max-bulk-len`` and ``client-query-buffer-limit``
        (every primary's in a cluster, the lowest of each kept): a store over either is
        refused before it is sent (``_within_bulk_limit``).  Read at open, by every probe
        that reaches the store, before an object over the limits last read is refused (a
        limit raised since), and after a store's connection failed the way a value over a
        lowered limit fails it.  A store that does not answer keeps the limits
        last read; one that refuses CONFIG GET is assumed to keep Redis's defaults
        (``_say_limits_assumed``)."""
        client = self.client
        nodes = (
            [client]
            if isinstance(client, Redis)
            else [client.get_redis_connection(n) for n in client.get_primaries()]
        )
        try:
            limits, assumed = read_limits(nodes)
        except (RedisError, RedisClusterException) as exc:
            log.debug("%s: the store's limits not read (%s)", self.context.name, exc)
            return
        self._say_limits_assumed(assumed)
        before, self._limits = self._limits, limits
        if limits != before:
            log.info(
                "%s: the store's limits are now proto-max-bulk-len %d, client-query-buffer-limit %d",
                self.context.name,
                limits.bulk,
                limits.query_buffer,
            )

    def _say_limits_assumed(self, assumed: bool) -> None:
        """Count (``store_limits_assumed``) and say in one warning that the limits are now
        partly Redis's defaults, not the store's -- at open, or when a store that answered
        CONFIG GET stops (a failover to a managed store, an ACL changed): a limit set lower
        there is not seen before an object over it is sent, which the store drops the
        connection on (refused alone, ``_store_each_alone``).  The reads while it
        lasts (every probe, every dropped store) say nothing more."""
        with self._limits_lock:
            started = assumed and not self._limits_assumed
            self._limits_assumed = assumed
        if not started:
            return
        self.context.count("store_limits_assumed")
        defaults = default_limits()
        log.warning(
            "%s: CONFIG GET of proto-max-bulk-len or client-query-buffer-limit is refused: "
            "Redis's defaults (%d and %d bytes) are assumed where it is, and an object over a "
            "lower limit set there is sent, dropped by the store and refused "
            "(store_refused_dropped_alone; grant the user +config|get to read them)",
            self.context.name,
            defaults.bulk,
            defaults.query_buffer,
        )

    def _warn_of_ignored_nodes(self) -> None:
        """Several ``startup_nodes`` without ``cluster_mode``: only the first is used, and
        an operator who listed the others may take them for failover targets."""
        ignored = ignored_nodes(self.config)
        if ignored:
            host, port = self.config.seed_nodes()[0]
            log.warning(
                "%s: startup_nodes lists %d nodes but cluster_mode is false: uses %s only, "
                "ignores %s (set cluster_mode: true for a Redis Cluster, or list one node)",
                self.context.name,
                len(ignored) + 1,
                f"{host}:{port}",
                ", ".join(ignored),
            )

    def _refuse_missing_permissions(self, client: Redis | RedisCluster) -> None:
        """Refuse to start when the store's ACL denies this user a command the adapter
        sends, naming each: otherwise every lookup would fail, every store or delete be
        refused object by object, long after start-up.  The commands are queued in a
        MULTI and discarded -- the store checks permissions (commands and key patterns)
        as it queues them, and runs none -- on a name under the prefix never written.
        A cluster is checked on every primary: each node keeps its own ACL, and each
        serves its share of the keys."""
        with self._permission_lock:
            denied, unchecked, _ = self._unchecked_permission_refusals_locked(client)
        # A replica, a loading or full store refuses writes for everybody; it heals (the
        # circuit sees its refusals), so it is no reason not to start.
        self._warn_unchecked(unchecked)
        if denied:
            raise ConfigError(self._denial(denied))

    def _warn_unchecked(self, unchecked: list[str]) -> None:
        if unchecked:
            log.warning(
                "%s: could not check the Redis user's permissions for %s",
                self.context.name,
                "; ".join(unchecked),
            )

    def _denial(self, denied: list[str]) -> str:
        return (
            f"{self.context.name}: the Redis user may not run what the adapter needs "
            f"({'; '.join(denied)}): grant it SET, GET, GETRANGE, SCAN, EVALSHA, EVAL "
            f"and UNLINK on keys {self.prefix!r}*"
        )

    def _unchecked_permission_refusals(
        self, client: Redis | RedisCluster, *, pausing: bool = False, waiting: bool = True
    ) -> tuple[list[str], list[str], int] | None:
        """``_unchecked_permission_refusals_locked`` under ``_permission_lock``, held
        across the check's I/O (two checks' verdicts on the same nodes must not
        interleave).  Start-up and the circuit's probe wait for a check running; a call
        (not ``waiting``) does not -- it may wait out a node's timeout -- and None
        answers it then."""
        if not self._permission_lock.acquire(blocking=waiting):
            return None
        try:
            return self._unchecked_permission_refusals_locked(client, pausing=pausing)
        finally:
            self._permission_lock.release()

    def _unchecked_permission_refusals_locked(
        self, client: Redis | RedisCluster, *, pausing: bool = False
    ) -> tuple[list[str], list[str], int]:
        """``permission_refusals`` of the store, or of each cluster primary not checked
        yet, and the check's number (later checks have higher ones); a node that gave a
        verdict, and no denial, is remembered as checked, and ``_permissions_owed`` says
        whether any is left.  A single store that does not answer raises.  ``pausing``:
        leave out the primaries that did not answer their last check, until their pause
        ends (``_node_check_paused``).  Call with ``_permission_lock`` held."""
        self._checks_made += 1
        check = self._checks_made
        if isinstance(client, Redis):
            primaries = {self.target}
            try:
                denied, unchecked = permission_refusals(client, self.prefix + PERMISSION_PROBE)
            except ResponseError:  # it answered, refusing the check itself: asking again gets the same
                self._checked_nodes |= primaries
                self._permissions_owed = False
                raise
            allowed = set() if denied else primaries
        else:
            denied, unchecked, allowed = self._cluster_permission_refusals(client, pausing)
            primaries = primary_names(client)
        self._checked_nodes |= allowed
        self._permissions_owed = not primaries <= self._checked_nodes
        return denied, unchecked, check

    def _cluster_permission_refusals(
        self, client: RedisCluster, pausing: bool = False
    ) -> tuple[list[str], list[str], set[str]]:
        """``permission_refusals`` of every primary not checked yet, each on a probe name
        of a slot that primary serves (one of another slot would be answered MOVED,
        checking nothing): the refusals of every primary that denies (``_standing_denials``),
        each prefixed with the node's address, and the names of the nodes that answered and
        denied nothing.  A primary that does not answer is named unchecked and the others
        are still checked: a denial found on a live primary refuses the start whatever
        another node does."""
        unchecked: list[str] = []
        allowed: set[str] = set()
        probes = cluster_probe_names(client, self.prefix + PERMISSION_PROBE)
        for node in client.get_primaries():
            if node.name in self._checked_nodes or (pausing and self._node_check_paused(node.name)):
                continue
            name = probes.get(node.name)
            if name is None:  # holds none of the keys: nothing to refuse, said in the warning
                unchecked.append(f"{node.name}: serves no slot")
                allowed.add(node.name)
                continue
            try:
                node_denied, node_unchecked = permission_refusals(client.get_redis_connection(node), name)
            except (RedisError, RedisClusterException) as exc:  # down, hung or refusing: it heals like any
                unchecked.append(f"{node.name}: {_unanswered_check(exc)}")
                if isinstance(exc, ResponseError):  # it answered: asking again gets the same
                    allowed.add(node.name)
                else:
                    self._pause_node_check(node.name)
                continue
            self._node_check_pauses.pop(node.name, None)
            if node_denied:
                self._denying_nodes[node.name] = [f"{node.name} {refusal}" for refusal in node_denied]
            else:
                allowed.add(node.name)
            unchecked += [f"{node.name} {refusal}" for refusal in node_unchecked]
        return self._standing_denials(client, allowed), unchecked, allowed

    def _standing_denials(self, client: RedisCluster, allowed: set[str]) -> list[str]:
        """The refusals of every primary whose last verdict was a denial, after this
        check's verdicts (``allowed`` denies no more): one that gave no verdict this time
        (hung, or left out for its pause) still denies -- a check that did not reach it
        says nothing of its ACL.  A node no longer a primary is sent nothing, and
        forgotten (call with ``_permission_lock`` held)."""
        primaries = primary_names(client)
        for node in [node for node in self._denying_nodes if node in allowed or node not in primaries]:
            del self._denying_nodes[node]
        return [refusal for refusals in self._denying_nodes.values() for refusal in refusals]

    def _node_check_paused(self, node: str) -> bool:
        """Whether a call leaves ``node`` out of its check: it did not answer its last
        one, and its pause has not ended (counted; call with ``_permission_lock`` held)."""
        pause = self._node_check_pauses.get(node)
        if pause is None or time.monotonic() >= pause[0]:
            return False
        self.context.count("permission_checks_paused")
        return True

    def _pause_node_check(self, node: str) -> None:
        """``node`` did not answer its check: calls check it again after a pause twice
        as long as the last (call with ``_permission_lock`` held)."""
        _, pause = self._node_check_pauses.get(node, (0.0, NODE_CHECK_PAUSE_FIRST_S))
        self._node_check_pauses[node] = (time.monotonic() + pause, min(2 * pause, NODE_CHECK_PAUSE_MAX_S))
        log.debug(
            "%s: %s did not answer the permission check: calls check it again in %gs",
            self.context.name,
            node,
            pause,
        )

    def _refuse_calls_while_denied(self) -> None:
        """Before each call: check the primaries start-up could not, or that denied (at
        most once per ``OWED_CHECK_INTERVAL_S``, so a node still down does not cost every
        call the check's timeout), and refuse the call while the last check found a
        denial -- with the circuit breaker off too, and until the ACL is fixed."""
        if not self._permissions_owed and not self._new_primary_found():
            return
        if self._owed_check_claimed():
            self._check_owed_permissions(pausing=True, waiting=False)
        if self._denied is not None:
            self.context.count("calls_refused_for_permissions")
            raise PermissionsDenied(self._denied)

    def _new_primary_found(self) -> bool:
        """Whether the cluster's slot map (as the client last learned it, no I/O) names
        a primary no check has found allowed -- a replica promoted since every primary
        was checked: its checks are owed then (each node keeps its own ACL)."""
        client = self._client
        if not isinstance(client, RedisCluster):
            return False
        primaries = primary_names(client)
        new = primaries - self._checked_nodes
        if not new:
            return False
        self._permissions_owed = True
        log.info(
            "%s: new cluster primary %s: its permissions are checked",
            self.context.name,
            ", ".join(sorted(new)),
        )
        return True

    def _owed_check_claimed(self) -> bool:
        """Whether this call makes the owed check: one call per ``OWED_CHECK_INTERVAL_S``,
        the calls running meanwhile go on without it (they neither wait for nor repeat it)."""
        now = time.monotonic()
        with self._verdict_lock:
            if now < self._next_owed_check:
                return False
            self._next_owed_check = now + OWED_CHECK_INTERVAL_S
            return True

    def _check_owed_permissions(self, *, pausing: bool = False, waiting: bool = True) -> None:
        """Check the primaries that gave no verdict yet (``pausing``: see
        ``_unchecked_permission_refusals``); a denial refuses every call until a check
        (the circuit's probe) finds the node allowed.  Not ``waiting`` (a call's check):
        while another check runs -- it may wait out a node's timeout -- none is made, and
        the call goes on with the verdict it has (counted ``permission_checks_skipped_busy``):
        the running check's verdict is the one this check would give."""
        try:
            verdict = self._unchecked_permission_refusals(self.client, pausing=pausing, waiting=waiting)
            if verdict is None:
                self.context.count("permission_checks_skipped_busy")
                log.debug("%s: a permission check is running: this call goes on", self.context.name)
                return
            denied, unchecked, check = verdict
        except ResponseError as exc:  # it answered, refusing the check itself: not asked again
            self._warn_unchecked([f"{self.target}: {_unanswered_check(exc)}"])
            return
        except (RedisError, RedisClusterException) as exc:  # not answering yet: still owed
            log.debug("%s: permission check not answered yet (%s)", self.context.name, exc)
            return
        # Said once, as at start-up; a node that did not answer is asked again (debug).
        answered = [entry for entry in unchecked if ": did not answer (" not in entry]
        with self._verdict_lock:
            news = [entry for entry in answered if entry not in self._unchecked_said]
            self._unchecked_said.update(news)
        self._warn_unchecked(news)
        self._set_denial(self._denial(denied) if denied else None, check)

    def _set_denial(self, denial: str | None, check: int) -> None:
        """Record the verdict of check number ``check``, unless a later check's is
        recorded already (counted, logged at debug: that verdict is the fresher).  A new
        denial is counted (``permissions_denied``) and logged once: every probe and, once
        a second, a call checks again while it lasts, and finding the same denial is no
        news."""
        with self._verdict_lock:
            stale = check < self._verdict_of_check
            if not stale:
                self._verdict_of_check = check
                before, self._denied = self._denied, denial
        if stale:
            self.context.count("permission_verdicts_stale")
            log.debug(
                "%s: the verdict of permission check %d came after a later one's: dropped",
                self.context.name,
                check,
            )
            return
        if denial is not None and denial != before:
            self.context.count("permissions_denied")
            log.error("%s; its calls are refused until a probe finds it allowed", denial)
        elif denial is None and before is not None:
            log.info("%s: the Redis user is now allowed what the adapter needs", self.context.name)

    def ping(self) -> None:
        client = self.client
        if isinstance(client, RedisCluster):
            # A cluster's PING goes to one node: the probe would close the circuit while
            # another primary, holding its share of the keys, answers nothing.
            client.ping(target_nodes=RedisCluster.PRIMARIES)
        else:
            client.ping()
        # Read at each probe: the store answering again may be another (a failover), or
        # restarted with other limits.
        self._read_bulk_limit()
        # Primaries answering for the first time since start-up (or promoted since) are
        # checked now: the circuit must not close on a node whose ACL denies the
        # adapter's commands.
        if self._permissions_owed or self._new_primary_found():
            self._check_owed_permissions()
            if self._denied is not None:
                raise PermissionsDenied(self._denied)

    def interrupt(self) -> None:
        # Closing sockets ends calls waiting on a store that stopped answering.
        self.close()

    def close(self) -> None:
        self._closing.set()
        if self._direct is not None:
            self._direct.shutdown()
        client = self._client
        if client is None:
            return
        # A Redis built on a pool it was given leaves that pool open on close() -- the
        # client here, and every node's client of a cluster built from a url: their
        # connections (in use ones too, which ends a call waiting on them) close here.
        for pool in _pools_of(client):
            pool.disconnect()
        client.close()

    def capacity(self) -> int | None:
        return self._capacity

    # -- the batch methods ----------------------------------------------------------------------

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        self._refuse_calls_while_denied()
        stored = [False] * len(keys)
        outcome = self._store_trips(keys, payloads, range(len(keys)), stored, 0, may_reread=True)
        if isinstance(outcome, _LimitsLowered):
            # The dropped objects and the rest sent again: SET of the same bytes again is
            # harmless, and the objects over the limits now read are refused this time.
            earlier = outcome.failure
            outcome = self._store_trips(
                keys, payloads, outcome.unsent, stored, outcome.first_trip, may_reread=False
            )
            assert not isinstance(outcome, _LimitsLowered)
            outcome = earlier or outcome
        return self._partly_done("store", stored, outcome)

    def _store_trips(
        self,
        keys: Sequence[ObjectKey],
        payloads: Sequence[memoryview],
        indices: Sequence[int],
        stored: list[bool],
        first_trip: int,
        *,
        may_reread: bool,
    ) -> Exception | _LimitsLowered | None:
        """Store the objects at ``indices`` (marked in ``stored``) trip by trip, numbered
        from ``first_trip``: the first failed node's or trip's error, or -- when a trip's
        connection was dropped on an object over the store's limits read again
        (``may_reread``; ``_over_limits_read_again``) -- the indices left to send again: the
        dropped ones and those of the later trips (what other cluster nodes answered in
        that trip is counted).  A trip dropped with no object over the limits read, by a
        store that answers right after, is sent again one object per trip
        (``_store_each_alone``); one that does not answer fails the trip, as before."""
        failure: Exception | None = None
        headers = RecordHeaders(self.context, keys, payloads)
        sendable = self._within_bulk_limit(keys, headers, indices)
        sizes = [payloads[index].nbytes for index in sendable]
        windows = list(trips(sizes, self.config.pipeline_max_bytes))
        for number, trip in enumerate(windows, first_trip):
            batch = [sendable[position] for position in trip]
            following = number - first_trip + 1
            upcoming = (
                [sendable[position] for position in windows[following]] if following < len(windows) else []
            )
            try:
                replies: list[Any] | Exception = self._send_records(keys, payloads, headers, batch, upcoming)
            except (RedisError, RedisClusterException) as exc:
                replies = exc
            dropped = _dropped_indices(batch, replies) if may_reread else []
            resend = self._over_limits_read_again(dropped, headers)
            if resend:
                failure = failure or self._record_answered(keys, batch, replies, stored, resend)
                first = _first_failing_trip(number, stored)
                return _LimitsLowered([*resend, *sendable[trip.stop :]], first, failure)
            if dropped and self._store_answers(keys[dropped[0]]):
                # Dropped on something it was sent, not gone down: an object over a limit
                # the store would not let CONFIG GET read (or a proxy's) -- told apart by
                # sending each alone.
                failure = failure or self._record_answered(keys, batch, replies, stored, dropped)
                lost = self._store_each_alone(keys, payloads, dropped, stored)
                if lost is not None:
                    error, unsent = lost
                    left = unsent + len(sendable) - trip.stop
                    error = self._trip_failed(error, _first_failing_trip(number, stored), "store", left)
                    failure = failure or error
                    break
                continue
            if isinstance(replies, Exception):
                failure = self._trip_failed(replies, number, "store", len(sendable) - trip.start)
                break
            trip_failure = self._record_stored(keys, list(zip(batch, replies, strict=True)), stored)
            failure = failure or trip_failure
        return failure

    def _send_records(
        self,
        keys: Sequence[ObjectKey],
        payloads: Sequence[memoryview],
        headers: RecordHeaders,
        batch: list[int],
        upcoming: list[int],
    ) -> list[Any]:
        """One store trip: SET of the records ``batch`` indexes, each key's reply (see
        ``_execute``).  On a standalone store on this thread's own connection, the headers
        of ``upcoming`` (the next trip) taken while the store reads this one (writes.py);
        through redis-py's pipeline in a cluster."""
        if self._direct is None:
            pipe = self._pipeline()
            for index in batch:
                # redis-py sends one value per argument: header and payload joined here
                value = b"".join((headers.of(index), payloads[index]))
                pipe.execute_command("SET", self.name_of(keys[index]), value)
            return self._execute(pipe, per_key=True)
        names = {index: self.name_of(keys[index]).encode() for index in batch}
        trip = RecordTrip(self._direct, names, payloads, headers, batch, upcoming)
        return self._execute(trip, per_key=True)

    def _record_stored(
        self,
        keys: Sequence[ObjectKey],
        answered: list[tuple[int, Any]],
        stored: list[bool],
        unanswered: Collection[int] = (),
    ) -> Exception | None:
        """Mark in ``stored`` the objects the store's replies ``answered`` (index, reply)
        say stored, leaving out the ``unanswered`` ones; count and log the others, and
        answer the first failed node's error."""
        failure: Exception | None = None
        for index, reply in answered:
            if index in unanswered:
                continue
            if per_object_error(reply):
                self._reply_error("store", keys[index], reply)
            elif isinstance(reply, Exception):  # a failed node, or another client error
                self._request_failed("store", keys[index], reply)
                failure = failure or reply
            else:
                stored[index] = True
        return failure

    def _record_answered(
        self,
        keys: Sequence[ObjectKey],
        batch: list[int],
        replies: list[Any] | Exception,
        stored: list[bool],
        dropped: Collection[int],
    ) -> Exception | None:
        """Mark stored what a dropped trip's other cluster nodes answered stored (their
        commands were done, and count now), leaving out the ``dropped`` objects; the
        first failed node's error."""
        answered = [] if isinstance(replies, Exception) else list(zip(batch, replies, strict=True))
        return self._record_stored(keys, answered, stored, set(dropped))

    def _store_answers(self, key: ObjectKey) -> bool:
        """Whether the store (the cluster node of ``key``) answers a PING on a connection
        of its own, right after it dropped a trip: if not, it went down, and the drop is
        a failure of the store, not the doing of an object it was sent."""
        client = self.client
        try:
            if isinstance(client, RedisCluster):
                client.get_redis_connection(client.get_node_from_key(self.name_of(key))).ping()
            else:
                client.ping()
        except (RedisError, RedisClusterException) as exc:
            log.debug("%s: no answer after a dropped store trip (%s)", self.context.name, exc)
            return False
        return True

    def _store_each_alone(
        self,
        keys: Sequence[ObjectKey],
        payloads: Sequence[memoryview],
        dropped: list[int],
        stored: list[bool],
    ) -> tuple[Exception, int] | None:
        """Store the objects of a trip the store dropped, and answers since, one per trip
        in order: one dropped again while the store still answers is refused alone
        (``_refuse_dropped_alone``), the others are stored and accounted -- those the trip
        wrote before its drop too (SET of the same bytes again).  One dropped alone
        already is refused without being sent again.  Each is sent once more (redis-py
        resends a dropped pipeline once): bounded by the trip.  The error, and how many
        objects it leaves unsent, when the store fails meanwhile."""
        headers = RecordHeaders(self.context, keys, payloads)
        if len(dropped) == 1:
            self._refuse_dropped_alone(keys[dropped[0]], headers.value_length(dropped[0]))
            return None
        for position, index in enumerate(dropped):
            try:
                reply: Any = self._send_records(keys, payloads, headers, [index], [])[0]
            except (RedisError, RedisClusterException) as exc:
                reply = exc
            if _dropped_connection(reply) and self._store_answers(keys[index]):
                self._refuse_dropped_alone(keys[index], headers.value_length(index))
            elif per_object_error(reply):
                self._reply_error("store", keys[index], reply)
            elif isinstance(reply, Exception):
                return reply, len(dropped) - position
            else:
                stored[index] = True
        return None

    def _refuse_dropped_alone(self, key: ObjectKey, size: int) -> None:
        """An object the store closed the connection on, sent alone, while it answers:
        over a limit the adapter could not read -- refused, counted, logged; not a
        failure of the store (which would feed the circuit breaker)."""
        self.context.count("store_refused_dropped_alone")
        limits = self._limits
        self.context.warn(
            "dropped_alone",
            "%s not stored: the store closed the connection on its %d bytes sent alone, and "
            "answers: taken for an object over a limit not read (proto-max-bulk-len %d, "
            "client-query-buffer-limit %d bytes %s)",
            key.file_stem(),
            size,
            limits.bulk,
            limits.query_buffer,
            "assumed: CONFIG GET is refused" if self._limits_assumed else "as read; a proxy's?",
        )

    def _over_limits_read_again(self, dropped: list[int], headers: RecordHeaders) -> list[int]:
        """The objects of a store trip to send again: those whose connection (the
        trip's, or a cluster node's) was dropped, when one of them is over the store's
        limits read again -- what an object over a limit lowered since it was last read
        gets (a ``CONFIG SET`` since, a failover to a store configured lower); none
        otherwise.  The limits may have been read lower meanwhile (by the probe, or
        another call), so the objects are held against them, not the limits before."""
        if not dropped:
            return []
        self._read_bulk_limit()
        limit = self._limits.longest_value
        return dropped if any(headers.value_length(index) > limit for index in dropped) else []

    def _within_bulk_limit(
        self, keys: Sequence[ObjectKey], headers: RecordHeaders, indices: Sequence[int]
    ) -> Sequence[int]:
        """Those of ``indices`` whose values (header and payload) the store takes; each longer than its
        ``proto-max-bulk-len``, or than its ``client-query-buffer-limit`` holds, is
        refused here, counted and logged -- sent, it would make the store close the
        connection, failing the whole batch.  Before refusing, the limits are read again:
        a limit raised since (``CONFIG SET``) drops no connection and starts no probe, so
        nothing else would read it, and every such object would stay refused, logged
        with a limit the store no longer has.  One ``CONFIG GET`` per batch holding such
        an object, which is not sent."""
        limit = self._limits.longest_value
        if all(headers.surely_within(index, limit) for index in indices):
            return indices
        if any(headers.value_length(index) > limit for index in indices):
            self._read_bulk_limit()
        limits = self._limits
        limit = limits.longest_value
        sendable = []
        for index in indices:
            if headers.value_length(index) <= limit:
                sendable.append(index)
                continue
            self.context.count("store_refused_over_bulk_limit")
            self.context.warn(
                "bulk_limit",
                "%s not stored: %d bytes, over what the store takes in one command "
                "(proto-max-bulk-len %d, client-query-buffer-limit %d bytes)",
                keys[index].file_stem(),
                headers.value_length(index),
                limits.bulk,
                limits.query_buffer,
            )
        return sendable

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[ObjectSize | None]:
        self._refuse_calls_while_denied()
        found: list[ObjectSize | None] = [None] * len(keys)
        for trip in trips([0] * len(keys), 1):
            names = [self.name_of(keys[index]) for index in trip]
            if self._direct is not None:
                replies = self._direct.call(functools.partial(self._read_headers, names=names))
            else:
                pipe = self._pipeline()
                for name in names:
                    self._queue_lookup(pipe, name)
                replies = self._execute(pipe)
            for position, index in enumerate(trip):
                head_reply, length_reply = replies[2 * position], replies[2 * position + 1]
                found[index] = self._checked_size(
                    keys[index], names[position], head_reply, length_reply, "lookup"
                )
        return found

    @staticmethod
    def _read_headers(send: Send, reader: ReplyReader, names: list[str]) -> list[Any]:
        """Each name's value's head and its length, one after the other."""
        send(b"".join(lookup_commands(name.encode()) for name in names))
        replies: list[Any] = []
        for _ in names:
            replies.append(reader.bulk_reply())
            replies.append(reader.integer_reply())
        return replies

    def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        self._refuse_calls_while_denied()
        if self._direct is None:
            return self._load_pipelined(keys, buffers)
        return self._load_direct(self._direct, keys, buffers)

    def _load_pipelined(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        """Loads through redis-py's cluster pipeline (it follows slot moves and redirects)."""
        loaded = [False] * len(keys)
        for trip in trips([buffer.nbytes for buffer in buffers], self.config.pipeline_max_bytes):
            pipe = self._pipeline()
            for index in trip:
                pipe.get(self.name_of(keys[index]))
            for index, reply in zip(trip, self._execute(pipe), strict=True):
                loaded[index] = self._fill(keys[index], reply, buffers[index])
        return loaded

    def _load_direct(
        self, direct: DirectConnections, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]
    ) -> list[bool]:
        """Loads on this thread's own connection, each payload received into its buffer.

        The GETs of the next trip are sent before the replies of the current one are
        read, so the store is never idle between trips while at most two trips of
        replies wait in its output buffer.  Reply errors and damaged records are acted
        on once every reply was read (a retry after a dropped connection reads again).
        """
        windows = list(trips([buffer.nbytes for buffer in buffers], self.config.pipeline_max_bytes))
        if not windows:
            return []
        loaded, problems = direct.call(
            lambda send, reader: self._read_loads(send, reader, keys, buffers, windows)
        )
        for key, problem in problems:
            if refuses_everything(problem):
                raise problem  # type: ignore[misc]
            if isinstance(problem, ResponseError):
                self._reply_error("load", key, problem)
            elif callable(problem):
                problem()  # a miss that is kept: counted and logged
            else:
                self._discard(key, *problem)
        return loaded

    def _read_loads(
        self,
        send: Send,
        reader: ReplyReader,
        keys: Sequence[ObjectKey],
        buffers: Sequence[memoryview],
        windows: list[range],
    ) -> tuple[list[bool], list[tuple[ObjectKey, Problem]]]:
        loaded = [False] * len(keys)
        problems: list[tuple[ObjectKey, Problem]] = []

        def request(trip: range) -> None:
            send(b"".join(pack_command(b"GET", self.name_of(keys[i]).encode()) for i in trip))

        request(windows[0])
        for number, trip in enumerate(windows):
            if number + 1 < len(windows):
                request(windows[number + 1])
            for index in trip:
                outcome = self._receive(reader, keys[index], buffers[index])
                if outcome is True:
                    loaded[index] = True
                elif outcome is not None:
                    problems.append((keys[index], outcome))
        return loaded, problems

    def _receive(
        self, reader: ReplyReader, key: ObjectKey, buffer: memoryview
    ) -> Problem | Literal[True] | None:
        """One GET reply: True when ``buffer`` holds the verified payload, None for a
        plain miss, else what is wrong with the object (acted on by the caller once every
        reply was read, so a retried call counts nothing twice).  The header is read and
        checked before a byte of the payload is: one that does not describe a payload of
        the buffer's size is read past."""
        total = reader.bulk_start()
        if isinstance(total, ResponseError):
            return total
        if total <= 0:
            reader.skip_part(max(total, 0))
            if total == 0:
                reader.end_bulk()
            return None
        head = reader.part(min(total, PREFIX_SIZE))
        split = split_head(head, total)
        if isinstance(split, int):  # the rest of the header
            head += reader.part(split - len(head))
            split = head
        if not isinstance(split, bytes):
            reader.skip_part(total - len(head))
            reader.end_bulk()
            assert isinstance(split, RecordError)  # a value of one byte or more has a head
            return head, split, length_guard(total)
        header_bytes = split
        payload_len = total - len(header_bytes)
        try:
            header = self.context.read_record_header(header_bytes, key)
        except RecordError as exc:
            reader.skip_part(payload_len)
            reader.end_bulk()
            if record_verdict(exc).kept:  # counted and logged once every reply was read
                return functools.partial(self._deletes.kept_record, key, exc)
            return header_bytes, exc, NO_GUARD
        if header is None or payload_len != header.payload_len or payload_len != buffer.nbytes:
            reader.skip_part(payload_len)
            reader.end_bulk()
            if header is None:
                return None
            # Checked against the header before a byte reaches the caller's buffer: a
            # payload of the buffer's size that its header does not describe is damage.
            if payload_len != header.payload_len:
                return header_bytes, payload_mismatch(payload_len, header.payload_len), length_guard(total)
            return functools.partial(self._size_changed, key, payload_len, buffer.nbytes)
        verifier = PayloadVerifier(header)
        reader.part_into(buffer, verifier.update)
        reader.end_bulk()
        try:
            verifier.verify()
        except RecordError as exc:
            return header_bytes, exc, digest_guard(header_bytes, buffer)
        return True

    def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Each record is read first and removed only if it is this server's to remove,
        and only if it is still the record read (a script compares its header): another
        key's intact record and a newer format's -- another writer replaced the object
        under this key's name -- are kept (``KeptByDelete``), as lookups keep them."""
        self._refuse_calls_while_denied()
        deleted = [False] * len(keys)
        failure: Exception | None = None
        for number, trip in enumerate(trips([0] * len(keys), 1)):
            left = len(keys) - trip.start
            judged = self._deletable(keys, trip, number, left)
            if isinstance(judged, Exception):
                failure = judged
                break
            removable, failure = judged[0], failure or judged[1]
            # Should the removals fail, the keys left are this trip's removable ones and
            # the later trips': the trip's kept records and failed reads are counted already.
            left = len(removable) + len(keys) - trip.stop
            removed = self._remove_unchanged(keys, removable, number, left)
            if isinstance(removed, Exception):
                failure = removed
                break
            for index, (done, failed) in removed.items():
                deleted[index] = done
                failure = failure or failed
        return self._partly_done("delete", deleted, failure)

    def _deletable(
        self, keys: Sequence[ObjectKey], trip: range, number: int, left: int
    ) -> tuple[dict[int, bytes], Exception | None] | Exception:
        """The heads judged (the header, or the first bytes of a value that is no record;
        b"" for none) of the keys of ``trip`` a delete may remove, and the first failed
        node's error; the error alone when the whole trip failed."""
        pipe = self._pipeline()
        for index in trip:
            pipe.execute_command("GETRANGE", self.name_of(keys[index]), 0, HEAD_READ - 1)
        replies = self._trip(pipe, number, "delete", left)
        if isinstance(replies, Exception):
            return replies
        removable: dict[int, bytes] = {}
        failure: Exception | None = None
        for index, reply in zip(trip, replies, strict=True):
            if per_object_error(reply):  # WRONGTYPE: not a record; NOPERM: refused
                self._reply_error("delete", keys[index], reply)
                continue
            if isinstance(reply, Exception):  # a failed node, or another client error
                self._request_failed("delete", keys[index], reply)
                failure = failure or reply
                continue
            head = bytes(reply)
            split = split_head(head, None)
            if isinstance(split, int):
                split = self._whole_head(self.name_of(keys[index]), split)
            if isinstance(split, bytes):
                if self._deletes.keeps(keys[index], split):
                    continue
                head = split
            # Nothing there (b""), a value that is no record (its head, as read), or this
            # server's record: removed while its value still starts with what was read.
            removable[index] = head
        return removable, failure

    def _whole_head(self, name: str, length: int) -> bytes | None:
        """The first ``length`` bytes of ``name``'s value -- a header longer than
        ``HEAD_READ`` -- read by a command of its own; None when the value is shorter now
        (replaced since the first read: a miss, the next lookup reads it anew)."""
        head = self.client.execute_command("GETRANGE", name, 0, length - 1)
        return bytes(head) if head is not None and len(head) == length else None

    def _remove_unchanged(
        self, keys: Sequence[ObjectKey], removable: dict[int, bytes], number: int, left: int
    ) -> dict[int, tuple[bool, Exception | None]] | Exception:
        """Remove each record whose header is still the one read: per index, whether it
        was removed (False too for one replaced since: core asks about it again) and the
        error of a failed node; the error alone when the whole pipeline failed."""
        if not removable:
            return {}
        replies = self._removal_replies(
            keys, removable, lambda pipe: self._trip(pipe, number, "delete", left)
        )
        if isinstance(replies, Exception):
            return replies
        outcome: dict[int, tuple[bool, Exception | None]] = {}
        for index, reply in replies.items():
            failed: Exception | None = None
            if per_object_error(reply):  # refused (NOPERM ...): still there
                self._reply_error("delete", keys[index], reply)
            elif isinstance(reply, Exception):
                self._request_failed("delete", keys[index], reply)
                failed = reply
            outcome[index] = (reply == 1, failed)
        return outcome

    def _removal_replies(
        self,
        keys: Sequence[ObjectKey],
        removable: dict[int, bytes],
        send: Callable[[Any], list[Any] | Exception],
        guard: PayloadGuard = NO_GUARD,
    ) -> dict[int, Any] | Exception:
        """Per index, the reply of its remove-if-unchanged script called by its digest
        through ``send`` -- the keys a node answered NOSCRIPT for sent the body once more,
        to that node alone; the error ``send`` returned when the whole pipeline failed.
        ``guard``: remove only a record whose payload is still the one judged."""
        sent = send(self._removal_pipeline(keys, removable, guard, by_sha=True))
        if isinstance(sent, Exception):
            return sent
        replies = dict(zip(removable, sent, strict=True))
        unknown = {
            index: removable[index] for index, reply in replies.items() if isinstance(reply, NoScriptError)
        }
        if unknown:
            replies.update(self._remove_sending_the_script(keys, unknown, guard))
        return replies

    def _remove_sending_the_script(
        self, keys: Sequence[ObjectKey], unknown: dict[int, bytes], guard: PayloadGuard
    ) -> dict[int, Any]:
        """Replies of the removals a node answered NOSCRIPT to (restarted, flushed, new),
        the script sent whole (which caches it there for later deletes); a pipeline that
        failed whole fails these keys alone -- the rest of the trip's removals were done."""
        try:
            pipe = self._removal_pipeline(keys, unknown, guard, by_sha=False)
            sent = self._execute(pipe, per_key=True)
        except (RedisError, RedisClusterException) as exc:
            return dict.fromkeys(unknown, exc)
        return dict(zip(unknown, sent, strict=True))

    def _removal_pipeline(
        self,
        keys: Sequence[ObjectKey],
        removable: dict[int, bytes],
        guard: PayloadGuard,
        *,
        by_sha: bool,
    ) -> Any:
        """The remove-if-unchanged script for each key, called by its digest (EVALSHA:
        no script body per key) or sent whole (EVAL)."""
        pipe = self._pipeline()
        command, script = ("EVALSHA", REMOVE_IF_UNCHANGED_SHA) if by_sha else ("EVAL", REMOVE_IF_UNCHANGED)
        for index, header in removable.items():
            # (execute_command: a cluster pipeline refuses eval(), yet routes EVAL by its key)
            pipe.execute_command(command, script, 1, self.name_of(keys[index]), header, *guard)
        return pipe

    def list_keys(self) -> Iterator[tuple[ObjectKey, ObjectSize | int]]:
        self._refuse_calls_while_denied()
        pattern = glob_escape(self.prefix) + "*"
        batch: list[tuple[ObjectKey, bytes]] = []
        foreign = 0
        unsized: list[ObjectKey] = []
        for raw in self.client.scan_iter(match=pattern, count=1000):
            name = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
            key = name_to_key(name[len(self.prefix) :]) if name.startswith(self.prefix) else None
            if key is None:
                self.context.count("listing_foreign_names")
                foreign += 1
                continue
            batch.append((key, raw))
            if len(batch) >= KEYS_PER_TRIP:
                yield from self._sizes(batch, unsized)
                batch = []
        yield from self._sizes(batch, unsized)
        self._warn_unsized(unsized)
        if foreign:
            log.warning(
                "%s: %d keys under %r are not object names of this cache; ignored",
                self.context.name,
                foreign,
                self.prefix,
            )

    # -- records --------------------------------------------------------------------------------

    def _warn_unsized(self, unsized: list[ObjectKey]) -> None:
        """One warning for a listing's records of another serde chain that STRLEN, denied
        by the store's ACL, could not size: optional, as a user granted the commands one
        by one before it was used may lack it -- they are left out of the usage instead."""
        if unsized:
            log.warning(
                "%s: %d records of another serde chain under %r are not counted in the usage "
                "and no eviction deletes them: the Redis user may not run STRLEN (grant it "
                "+strlen to size them)",
                self.context.name,
                len(unsized),
                self.prefix,
            )

    def _sizes(
        self, batch: list[tuple[ObjectKey, bytes]], unsized: list[ObjectKey]
    ) -> Iterator[tuple[ObjectKey, ObjectSize | int]]:
        """Each listed record's sizes: its header's, checked against its value's length
        (``_payload_agrees``), or -- a record of another serde chain -- that length alone.

        The keys' records are noted as being read (``reading_records``) from before their
        heads are read until every one is judged: a store of a key landing in between
        replaced the record read, and an old one of another serde chain must not mark the
        key a miss over the store's (nor a newer format's release the store's entry)."""
        sized: list[tuple[ObjectKey, ObjectSize | int]] = []
        with self.context.reading_records([key for key, _ in batch]):
            pipe = self._pipeline()
            for _, raw in batch:
                self._queue_lookup(pipe, raw)
            replies = self._execute(pipe)
            for position, (key, raw) in enumerate(batch):
                head_reply, length_reply = replies[2 * position], replies[2 * position + 1]
                header_bytes = self._header_bytes(key, raw, head_reply, length_reply, "listing")
                if header_bytes is None:
                    continue
                header = self._judged_header(key, header_bytes, "listing")
                if header == OTHER_CHAIN:
                    length = self._other_chain_size(key, header_bytes, length_reply, unsized)
                    if length:
                        sized.append((key, length))
                elif isinstance(header, RecordHeader) and self._payload_agrees(
                    key, header, header_bytes, length_reply, "listing"
                ):
                    sized.append((key, ObjectSize(header.payload_len, header.l1_size)))
        yield from sized

    def _other_chain_size(
        self, key: ObjectKey, header_bytes: bytes, reply: Any, unsized: list[ObjectKey]
    ) -> int:
        """A record of another serde chain (a kept miss) is listed by its payload's length
        (its value's, ``reply``, but its header):
        it holds memory in the store, so it counts against ``max_capacity_gb`` and an
        eviction may delete it, as other adapters list them.  Its header is not this
        chain's to read the sizes from.  0 (not listed) for one without a payload, or that
        STRLEN is denied for (``unsized``, counted ``listing_foreign_unsized``)."""
        if _denied(reply):
            self.context.count("listing_foreign_unsized")
            unsized.append(key)
            return 0
        if isinstance(reply, ResponseError):
            self._reply_error("listing", key, reply)
            return 0
        return max(int(reply) - len(header_bytes), 0)

    def _checked_size(
        self, key: ObjectKey, name: str | bytes, head_reply: Any, length_reply: Any, what: str
    ) -> ObjectSize | None:
        """The sizes of a record whose verified header (at the start of ``head_reply``, the
        value's head) describes a value as long as STRLEN measured (``length_reply``, from
        the same trip); None for a miss."""
        header_bytes = self._header_bytes(key, name, head_reply, length_reply, what)
        if header_bytes is None:
            return None
        header = self._header(key, header_bytes, what)
        if header is None or not self._payload_agrees(key, header, header_bytes, length_reply, what):
            return None
        return ObjectSize(header.payload_len, header.l1_size)

    def _header_bytes(
        self, key: ObjectKey, name: str | bytes, head_reply: Any, length_reply: Any, what: str
    ) -> bytes | None:
        """The header at the start of the value ``name`` holds, from its head read
        (``head_reply``) and its length (``length_reply``); a header longer than the
        head read is read again whole.  None for a miss: nothing there, an error reply
        about the object (counted; one about the store fails the call), or a value that
        can hold no record -- damage, counted and removed unless replaced meanwhile."""
        if refuses_everything(head_reply):
            raise head_reply
        if isinstance(head_reply, ResponseError):
            self._reply_error(what, key, head_reply)
            if not str(head_reply).startswith("WRONGTYPE"):
                # BUSY, NOPERM, MASTERDOWN ...: the object may well be there.  A miss would
                # read as "absent", and core would release its bytes and announce it gone.
                raise head_reply
            return None
        head = bytes(head_reply)
        # A head shorter than asked for is the whole value, whatever STRLEN answered.
        total = length_reply if isinstance(length_reply, int) else None
        if total is None and len(head) < HEAD_READ:
            total = len(head)
        split = split_head(head, total)
        if isinstance(split, int):
            text = name.decode("utf-8", "replace") if isinstance(name, bytes) else name
            split = self._whole_head(text, split)
        if isinstance(split, RecordError):
            self._discard(key, head, split, length_guard(total))
            return None
        return split

    def _payload_agrees(
        self, key: ObjectKey, header: RecordHeader, header_bytes: bytes, length_reply: Any, what: str
    ) -> bool:
        """Whether the stored value is as long as its header and the payload it describes.
        The crc proves the header intact, not that it describes the payload beside it (a
        buggy writer, or a hand edit, may pair them wrongly): believed, a size past the
        capacity would be accounted and the eviction would clear the cache for it.  A
        record that differs is damage -- a miss, counted and removed (unless replaced
        meanwhile), as a load finds it.  Where the ACL denies STRLEN the header is believed
        (counted, logged): loads still check the payload's length before a byte of it is
        used.  The two replies come from one trip, not one atomic read: a record another
        writer replaced between them by one of another length reads as damage -- a miss,
        counted, yet kept, as the removal is conditional on the header read and on the
        value still being the length read (one script, atomic): the object read, stored
        again since, is kept."""
        if length_reply == len(header_bytes) + header.payload_len:
            return True
        if _denied(length_reply):
            self.context.count("payload_length_unchecked")
            self.context.warn(
                "strlen_denied",
                "%s: its payload length is not checked against its header's %d bytes: the Redis "
                "user may not run STRLEN (grant it +strlen)",
                key.file_stem(),
                header.payload_len,
            )
            return True
        if isinstance(length_reply, ResponseError):
            if refuses_everything(length_reply):
                raise length_reply
            self._reply_error(what, key, length_reply)
            if not str(length_reply).startswith("WRONGTYPE"):
                raise length_reply  # the object may well be there: "absent" would be wrong
            return False  # replaced by something else since its header was read
        reason = payload_mismatch(int(length_reply) - len(header_bytes), header.payload_len)
        # Head and length were read by two commands: the removal keeps the record unless
        # its value is still the length read (the object the header describes, stored
        # again since, has the header read and is intact).
        self._discard(key, header_bytes, reason, length_guard(int(length_reply)))
        return False

    def _header(self, key: ObjectKey, reply: Any, what: str) -> RecordHeader | None:
        """The verified header in a reply; None (a miss) for anything else, except an
        error reply about the store rather than the object, which fails the call."""
        header = self._judged_header(key, reply, what)
        return header if isinstance(header, RecordHeader) else None

    def _judged_header(self, key: ObjectKey, reply: Any, what: str) -> RecordHeader | str | None:
        """``_header``, telling an intact record of another serde chain (``OTHER_CHAIN``:
        a miss, kept, counted by core) from the other misses."""
        if reply is None:
            return None
        if refuses_everything(reply):
            raise reply  # the call fails, counted by core: no object of it is answered for
        if isinstance(reply, ResponseError):
            self._reply_error(what, key, reply)
            if not str(reply).startswith("WRONGTYPE"):
                # BUSY, NOPERM, MASTERDOWN ...: the object may well be there.  A miss would
                # read as "absent", and core would release its bytes and announce it gone.
                raise reply
            return None
        try:
            header = self.context.read_record_header(reply, key)
        except RecordError as exc:
            if what == "listing" and record_verdict(exc) is RecordVerdict.FOREIGN:
                # An intact record of another key under a listed name: a server whose
                # key_prefix extends this one's ("cache" and "cache2") names its objects
                # like this server's objects of other keys.  Not this cache's: left alone.
                self.context.count("listing_foreign_names")
                self.context.warn("listing_foreign", "%s: %s; not listed, left alone", key.file_stem(), exc)
            elif not self._deletes.kept_record(key, exc):
                self._discard(key, reply, exc)
            return None
        return OTHER_CHAIN if header is None else header

    def _size_changed(self, key: ObjectKey, stored: int, wanted: int) -> None:
        """Replaced (e.g. by another server) since the lookup by an object of another size:
        a miss, nothing copied, the object kept."""
        self.context.count("load_size_changed")
        self.context.warn(
            "size_changed",
            "%s is %d bytes now, the load buffer %d (replaced since the lookup); a miss",
            key.file_stem(),
            stored,
            wanted,
        )

    def _fill(self, key: ObjectKey, reply: Any, buffer: memoryview) -> bool:
        """A GET's reply (redis-py's, in a cluster) into ``buffer``, once verified."""
        if refuses_everything(reply):
            raise reply
        if isinstance(reply, ResponseError):
            self._reply_error("load", key, reply)
            return False
        if not reply:
            return False
        value = memoryview(reply)
        split = split_head(bytes(value[:HEAD_READ]), value.nbytes)
        if isinstance(split, int):
            split = bytes(value[:split])
        if isinstance(split, RecordError):
            self._discard(key, bytes(value[:HEAD_READ]), split, length_guard(value.nbytes))
            return False
        assert split is not None
        header = self._header(key, split, "load")
        if header is None:
            return False
        payload = value[len(split) :]
        if payload.nbytes != header.payload_len:
            reason = payload_mismatch(payload.nbytes, header.payload_len)
            self._discard(key, split, reason, length_guard(value.nbytes))
            return False
        if payload.nbytes != buffer.nbytes:
            self._size_changed(key, payload.nbytes, buffer.nbytes)
            return False
        try:
            verify_payload(header, payload)
        except RecordError as exc:
            self._discard(key, split, exc, digest_guard(value))
            return False
        copy_into(buffer, payload)
        return True

    def _discard(
        self, key: ObjectKey, header_bytes: bytes, error: Exception, guard: PayloadGuard = NO_GUARD
    ) -> None:
        """Remove a record that failed verification, unless it was replaced meanwhile --
        as deletes remove, so a node that lost the script is sent it alone (a Script
        object would load it onto every primary, and fail while any is down).  ``guard``:
        the payload judged (its length, or the digest of its bytes), so that the same
        object stored again since -- the header bytes read, an intact payload -- is kept.
        Counted by what the script did: removed (its bytes released, ``record_removed``),
        not (stored again, replaced or removed since: no longer the record read), or failed."""
        accounted = self.context.accounted_size(key)  # before: a store settling since keeps its own
        try:
            replies = self._removal_replies([key], {0: header_bytes}, self._execute, guard)
            reply = replies if isinstance(replies, Exception) else replies[0]
            if isinstance(reply, Exception):  # a refusal (NOPERM ...), or the node failed
                raise reply
        except (RedisError, RedisClusterException) as exc:
            self.context.count("corrupt_remove_failures")
            self.context.warn("corrupt_remove", "could not remove %s (%s): %s", key.file_stem(), error, exc)
            return
        if reply == 1:
            self.context.count("corrupt_records_removed")
            self.context.warn("corrupt", "removed %s: %s", key.file_stem(), error)
            self.context.record_removed(key, accounted)
            return
        self.context.count("corrupt_records_replaced")
        self.context.warn(
            "corrupt_replaced",
            "%s read damaged (%s), not removed: no longer the record read -- stored again, "
            "replaced or removed since the read; a miss",
            key.file_stem(),
            error,
        )
