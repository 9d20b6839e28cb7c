"""Configuration of the ``redis`` adapter (also registered as LMCache's ``resp`` and
``valkey`` type names, whose JSON it accepts).

Imported whenever plugins are listed: it must not import redis-py.
"""

from __future__ import annotations

import urllib.parse
from typing import Annotated, ClassVar

import msgspec

from lmcache_tiers.plugin import FieldError, L2AdapterConfig, SizeGiB, check_size_gib, redact_url_secrets

DEFAULT_PORT = 6379
SCHEMES = ("redis", "rediss", "unix")
#: LMCache's type names for the same store, registered with LMCacheRedisConfig
LMCACHE_ALIASES = ("resp", "valkey")
#: joins LMCache valkey's key_prefix and an object's name (its wire keys use "@" too)
LMCACHE_PREFIX_SEPARATOR = "@"
REDACTED = "***"


def _doc(text: str, **constraints: object) -> msgspec.Meta:
    return msgspec.Meta(description=text, **constraints)  # type: ignore[arg-type]


Seconds = Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)]


def parse_nodes(raw: str | tuple[str, ...]) -> list[tuple[str, int]]:
    """``"h1:6379,h2:6379"`` (LMCache's form) or a list of ``"host:port"`` -> (host, port)s."""
    items = raw.split(",") if isinstance(raw, str) else list(raw)
    nodes: list[tuple[str, int]] = []
    for item in (entry.strip() for entry in items):
        if not item:
            continue
        if "@" in item:
            # user:password@host:port would be read as a host named "user:password@host",
            # printed by --print-config and named by every connection error: refused, and
            # not quoted, as this refusal is printed too.
            raise FieldError(
                "startup_nodes",
                "credentials are not accepted in startup_nodes (entries are host:port); "
                "give them as username and password",
            )
        host, sep, port = item.rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise FieldError(
                "startup_nodes",
                f"startup_nodes entries are host:port with a port from 1 to 65535, got {item!r}",
            )
        nodes.append((host, int(port)))
    if not nodes:
        raise FieldError("startup_nodes", "startup_nodes names no host:port")
    return nodes


def redact_url(url: str) -> str:
    """``url`` with the passwords inside it (if any: ``user:password@``, and
    ``?password=``, which redis-py reads too) replaced by ``***``."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.password is not None:
        user, _, host = parsed.netloc.rpartition("@")
        name = user.partition(":")[0]
        url = parsed._replace(netloc=f"{name}:{REDACTED}@{host}").geturl()
    return redact_url_secrets(url)


def url_database(parsed: urllib.parse.SplitResult) -> int | None:
    """The database a url names (``/3`` or ``?db=3``, as redis-py reads it); None if none."""
    query = urllib.parse.parse_qs(parsed.query).get("db")
    text = query[0] if query else parsed.path.lstrip("/") if parsed.scheme != "unix" else ""
    return int(text) if text.isdigit() else None


class RedisConfig(L2AdapterConfig):
    """Objects in Redis or Valkey (standalone, or a Redis Cluster), shared by every
    lmcache-tiers server that points at the same store.

    Each object is one string: a checksummed record header, then the payload, written by
    one SET (atomic: readers see the old object or the new one) and verified on every load;
    a damaged record is a miss and is removed. Lookups ask the store each time, so a
    chunk stored through one server is a hit through every other.

    Where to connect, one of: ``url`` (``redis://[user:password@]host:port/db``,
    ``rediss://`` for TLS, ``unix:///path/redis.sock?db=0``), ``host``/``port`` (LMCache's
    ``resp`` fields) or ``startup_nodes`` (LMCache's ``valkey`` field). ``cluster_mode``
    connects to a Redis Cluster, seeded from ``startup_nodes`` or ``url``.

    Credentials come from ``url``, ``username``/``password``, or the environment
    (``LMCACHE_RESP_USERNAME``, ``LMCACHE_RESP_PASSWORD``, read when the adapter starts);
    they are never logged nor printed.

    ``max_capacity_gb`` 0 leaves capacity to the store (``maxmemory`` and its policy;
    usage is -1 and lmcache-tiers never evicts); > 0 counts the bytes this server stored
    against it and, with an ``eviction`` block, evicts at the watermark. Each server
    counts what it stored and what it found at start, not what other servers add.

    A circuit breaker is on by default: while the store does not answer, lookups miss at
    once and stores are skipped; it closes by itself when the store answers again.
    """

    #: LMCache's resp and valkey fields without an equivalent here -> why
    lmcache_unsupported: ClassVar[dict[str, str]] = {
        "ttl_seconds": "objects carry no expiry; max_capacity_gb with eviction, or the store's "
        "maxmemory policy, bounds them",
    }

    url: Annotated[
        str | None, _doc("redis://, rediss:// or unix:// URL of the store (may carry credentials).")
    ] = None
    host: Annotated[str | None, _doc("Host of the store (LMCache resp); with `port`.")] = None
    port: Annotated[
        Annotated[int, msgspec.Meta(gt=0, lt=65536)] | None,
        _doc("Port of the store with `host`; default 6379."),
    ] = None
    startup_nodes: Annotated[
        str | tuple[str, ...] | None,
        _doc('Seed nodes, "host:port,host:port" or a list (LMCache valkey); standalone uses the first.'),
    ] = None
    cluster_mode: Annotated[bool, _doc("Connect to a Redis Cluster (seeded from startup_nodes or url).")] = (
        False
    )
    username: Annotated[
        str | None, _doc("ACL user name (printed by --print-config; the password never is).")
    ] = None
    password: Annotated[str | None, _doc("Password; never logged nor printed.")] = None
    database_id: Annotated[
        Annotated[int, msgspec.Meta(ge=0)] | None,
        _doc("Logical database of a standalone store (the /db of the url)."),
    ] = None
    tls_enable: Annotated[bool, _doc("Connect with TLS (as rediss:// does).")] = False
    key_prefix: Annotated[
        str,
        _doc(
            "Prepended to every object name; servers sharing a cache use the same one. Under "
            'the type names resp and valkey the default is "" and the prefix is joined by "@", '
            "as LMCache's valkey does.",
            max_length=128,
        ),
    ] = "lmcache-tiers:"
    request_timeout: Annotated[Seconds, _doc("Seconds a command may take before it fails.")] = 5.0
    connection_timeout: Annotated[
        Seconds, _doc("Seconds to establish a connection (LMCache valkey's default, 10).")
    ] = 10.0
    num_workers: Annotated[
        int,
        _doc(
            "Worker threads per operation kind (store, lookup, load); 8 under the type names "
            "resp and valkey, as LMCache's.",
            ge=1,
            le=64,
        ),
    ] = 2
    pool_size: Annotated[
        Annotated[int, msgspec.Meta(ge=1, le=1024)] | None,
        _doc("Connections kept per store node; null: enough for every worker."),
    ] = None
    pipeline_max_bytes: Annotated[
        int,
        _doc("Payload bytes per pipelined round trip; bounds the replies a batch has waiting.", ge=1 << 16),
    ] = 8 << 20
    max_capacity_gb: Annotated[
        SizeGiB,
        _doc(
            "Bytes this server may store, in GiB; 0: no limit of lmcache-tiers' own. Required for eviction.",
            ge=0.0,
        ),
    ] = 0.0

    def __post_init__(self) -> None:
        check_size_gib("max_capacity_gb", self.max_capacity_gb)
        if self.eviction is not None and self.max_capacity_gb == 0:
            # Usage is -1 without a capacity of this server's own: the eviction block would
            # never run, and the store would fill up to its maxmemory policy instead.
            raise FieldError(
                "eviction",
                "L2 eviction needs max_capacity_gb > 0 (it is what eviction keeps under; 0 leaves "
                "capacity to the store's maxmemory policy)",
            )
        given = [name for name in ("url", "host", "startup_nodes") if getattr(self, name) is not None]
        if not given:
            raise FieldError("url", "set one of url (redis://host:port), host or startup_nodes")
        if len(given) > 1:
            raise FieldError(
                given[1], f"set only one of url, host and startup_nodes (got {', '.join(given)})"
            )
        if self.port is not None and self.host is None:
            raise FieldError("port", "port goes with host")
        if self.host is not None and not self.host.strip():
            # No address (an unset variable expanded into the JSON): the adapter would start
            # and wait for ever for a store it cannot name, as LMCache refuses it.
            raise FieldError("host", "host is empty: give the store's address")
        if self.host is not None and "@" in self.host:
            # Like a startup node: a host named "user:password@host" is shown everywhere.
            raise FieldError(
                "host", "credentials are not accepted in host; give them as username and password"
            )
        if self.url is not None:
            self._check_url(self.url)
        if self.startup_nodes is not None:
            parse_nodes(self.startup_nodes)
        if self.cluster_mode:
            if self.url is not None and self.url.startswith("unix:"):
                raise FieldError("url", "a Redis Cluster is reached over TCP, not a unix socket")
            if self.database_id:
                raise FieldError("database_id", "a Redis Cluster has database 0 only")
            if "{" in self.key_prefix or "}" in self.key_prefix:
                raise FieldError(
                    "key_prefix",
                    "a hash tag ({...}) in key_prefix would put every object in one cluster slot",
                )
        if any(not char.isprintable() or char.isspace() for char in self.key_prefix):
            raise FieldError("key_prefix", "key_prefix must be printable, without spaces")
        if self.url is not None:
            self._check_url_agrees(self.url)
            if self.tls_enable and self.url.startswith("unix:"):
                raise FieldError("tls_enable", "TLS is not spoken over a unix:// socket; drop tls_enable")
            self._check_url_options(self.url)

    def _check_url_options(self, url: str) -> None:
        """The url's options (``?socket_timeout=``, ``?ssl_cert_reqs=``, ...) as redis-py
        takes them: a connection is made of it, not connected.  Otherwise an option it
        cannot read failed the start with a bare ValueError, and one it refuses only when
        it connects (an unknown name, an SSL option on a plain url, ``protocol=9``) read as
        a store that does not answer yet, and every call failed for good."""
        from redis import ConnectionPool  # lazily: listing plugins must not import redis-py
        from redis.exceptions import RedisError

        if self.tls_enable and url.startswith("redis:"):
            url = "rediss" + url[len("redis") :]  # as the adapter connects
        try:
            ConnectionPool.from_url(url).make_connection()
        except (ValueError, TypeError, RedisError) as exc:
            # redis-py's messages name the option (an ssl_cert_reqs flag too), not a password
            raise FieldError("url", f"redis-py refuses an option of the url: {exc}") from None

    def __repr__(self) -> str:
        # Never the password, nor the one inside the url (a repr may reach a log line).
        shown = []
        for name, value in msgspec.structs.asdict(self).items():
            if name == "password" and value is not None:
                value = REDACTED
            elif name == "url" and value is not None:
                value = redact_url(value)
            shown.append(f"{name}={value!r}")
        return f"{type(self).__name__}({', '.join(shown)})"

    def object_prefix(self) -> str:
        """What every object name starts with: ``key_prefix`` as given."""
        return self.key_prefix

    def _check_url_agrees(self, url: str) -> None:
        """A field that says again what the url says must say the same: redis-py would
        silently take the url's (the values are not shown: they may be secrets)."""
        parsed = urllib.parse.urlsplit(url)
        for name, in_url in (("username", parsed.username), ("password", parsed.password)):
            given = getattr(self, name)
            if given and in_url and urllib.parse.unquote(in_url) != given:
                raise FieldError(name, f"{name} contradicts the {name} inside url; give it once")
        db = url_database(parsed)
        if self.cluster_mode and db:
            raise FieldError("url", f"the url names database {db}; a Redis Cluster has database 0 only")
        if self.database_id is not None and db is not None and db != self.database_id:
            raise FieldError(
                "database_id", f"database_id {self.database_id} contradicts database {db} of the url"
            )

    @staticmethod
    def _check_url(url: str) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in SCHEMES:
            raise FieldError("url", f"url scheme must be one of {', '.join(s + '://' for s in SCHEMES)}")
        if parsed.scheme == "unix" and not parsed.path:
            raise FieldError("url", "a unix:// url needs the socket path: unix:///run/redis.sock")
        if parsed.scheme != "unix" and not parsed.hostname:
            raise FieldError("url", "the url names no host")
        try:
            port = parsed.port  # ValueError when it is not a number from 0 to 65535
        except ValueError:
            port = 0
        else:
            port = DEFAULT_PORT if port is None else port
        if parsed.scheme != "unix" and not 0 < port < 65536:
            # the url itself is not shown: it may carry a password
            raise FieldError("url", "the url's port must be a number from 1 to 65535")
        in_query = urllib.parse.parse_qs(parsed.query, keep_blank_values=True)
        in_path = parsed.path.strip("/") if parsed.scheme != "unix" else ""  # unix: the socket's
        for database in [*in_query.get("db", []), *([in_path] if in_path else [])]:
            if not (database.isascii() and database.isdigit()):
                # redis-py takes a path it cannot read as database 0, silently: another cache's
                raise FieldError(
                    "url", f"the url's database {database!r} is not a number (give /N or ?db=N, e.g. /0)"
                )
        if "decode_responses" in in_query:
            # redis-py would hand the records back as text (any value of it, "false" too,
            # turns decoding on): headers and payloads are binary.
            raise FieldError("url", "decode_responses is not accepted in the url: objects are binary")

    def seed_nodes(self) -> list[tuple[str, int]]:
        """(host, port) of the store, or the cluster's seed nodes (not for unix:// urls)."""
        if self.startup_nodes is not None:
            return parse_nodes(self.startup_nodes)
        if self.host is not None:
            return [(self.host, self.port or DEFAULT_PORT)]
        assert self.url is not None
        parsed = urllib.parse.urlsplit(self.url)
        return [(parsed.hostname or "", parsed.port or DEFAULT_PORT)]


class LMCacheRedisConfig(RedisConfig):
    """The ``redis`` adapter under LMCache's type names ``resp`` and ``valkey``: their
    JSON keeps LMCache 0.5.6's meanings, so a config moved from LMCache keeps its objects
    where it put them and its worker count.

    ``key_prefix`` is LMCache valkey's namespace: objects are named ``<key_prefix>@<key>``,
    or the bare key when it is ``""`` (the default, as LMCache's resp, which has no prefix,
    names them); a prefix holding ``@`` is refused, as LMCache refuses it. ``num_workers``
    defaults to 8, LMCache's. Every other field means what it does under ``redis``.
    """

    key_prefix: Annotated[
        str,
        _doc(
            'Namespace of the objects, joined to each name by "@" as LMCache\'s valkey does; '
            '"" (default, as LMCache\'s resp and valkey): no namespace. Must not contain "@".',
            max_length=128,
        ),
    ] = ""
    num_workers: Annotated[
        int,
        _doc("Worker threads per operation kind (store, lookup, load); 8, as LMCache's.", ge=1, le=64),
    ] = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        if LMCACHE_PREFIX_SEPARATOR in self.key_prefix:
            # LMCache refuses it too: "a@" + "b" and "a" + "@b" would be one namespace.
            raise FieldError(
                "key_prefix", f"key_prefix must not contain {LMCACHE_PREFIX_SEPARATOR!r} (it joins the names)"
            )

    def object_prefix(self) -> str:
        """``<key_prefix>@``, or nothing when ``key_prefix`` is empty: LMCache valkey's layout."""
        return self.key_prefix + LMCACHE_PREFIX_SEPARATOR if self.key_prefix else ""
