"""The s3fs client of one ``s3`` adapter, and the rules every request follows.

* Built on the adapter's own event loop (``open``), never shared with another adapter:
  s3fs caches instances per argument set, and a cached instance is bound to the loop
  that made it, so ``skip_instance_cache`` is always set.
* Every request is bounded: botocore's connect and read timeouts per attempt, botocore's
  standard retry mode for transient errors (``retries``), and ``request_timeout_s`` over
  the whole of it; s3fs's own retry loop is turned off so retries are not multiplied.
* The region is given to the botocore session as its default region -- what
  ``AWS_DEFAULT_REGION`` sets -- rather than as ``region_name`` in the client arguments:
  s3fs reads the latter as a bucket location constraint too, which ``us-east-1`` refuses.
  Setting it on this adapter's session leaves the process environment alone.
* botocore computes its optional CRC checksums of request and response bodies only where
  the S3 API requires them: a record carries its own checksum, verified on every read, and
  a store sends the CRC32 of its body itself (:func:`records.crc32_checksum`), as a plain
  header -- botocore's own would go as an aws-chunked trailer over HTTPS.
* Every session reads botocore's service models through the process's one loader
  (:mod:`service_models`): parsed once per process, not once per session.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import aiobotocore.session
import botocore.exceptions
import msgspec
import s3fs

from lmcache_plugin_s3.config import S3Config
from lmcache_plugin_s3.service_models import share_service_models
from lmcache_plugin_s3.tls_probe import speaks_tls
from lmcache_tiers.plugin import ConfigError

log = logging.getLogger("lmcache_plugin_s3")
T = TypeVar("T")


#: what a store answers an upload whose body does not match its checksum: damaged on the way
DAMAGED_UPLOAD = frozenset({"BadDigest", "XAmzContentSHA256Mismatch"})


class S3RequestError(Exception):
    """A request failed or ran out of time; the key it was for is a failure, not a miss."""


def is_missing_bucket(exc: BaseException) -> bool:
    """The bucket does not exist: every request on it fails until it is created."""
    return error_code(exc) == "NoSuchBucket"


#: how long an answer that proved the bucket exists vouches for a lookup's bare 404
BUCKET_TRUSTED_S = 5.0


def error_code(exc: BaseException) -> str | None:
    """The S3 error code behind an s3fs exception (s3fs keeps botocore's as the cause)."""
    for candidate in (exc, exc.__cause__):
        response = getattr(candidate, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            return str(code) if code is not None else None
    return None


def is_missing_object(exc: BaseException) -> bool:
    """True for "no such key" (a miss), and for the bare 404 of a HEAD, which says the
    same of a missing bucket (a HEAD answer has no body to name either): a lookup rules
    that out (:meth:`S3Client.bucket_vouched`); a missing bucket is a failure, never a miss."""
    return isinstance(exc, FileNotFoundError) and error_code(exc) in (None, "NoSuchKey", "404")


def is_bare_not_found(exc: BaseException) -> bool:
    """A 404 that names no error code: a missing object or a missing bucket."""
    return isinstance(exc, FileNotFoundError) and error_code(exc) in (None, "404")


def describe(exc: BaseException) -> str:
    code = error_code(exc)
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}{f' {code}' if code else ''}{f': {text}' if text else ''}"


def _endpoint_label(config: S3Config) -> str:
    return config.endpoint_url or f"AWS S3 ({config.region or 'default region'})"


def open_filesystem(config: S3Config) -> s3fs.S3FileSystem:
    """The s3fs filesystem of ``config``, bound to the running event loop (the benchmark
    uses it too, as the direct client the adapter is compared with)."""
    session = aiobotocore.session.AioSession(profile=config.profile)
    share_service_models(session)
    if config.region is not None:
        session.set_config_variable("region", config.region)
    fs = s3fs.S3FileSystem(
        asynchronous=True,
        loop=asyncio.get_running_loop(),
        skip_instance_cache=True,
        session=session,
        endpoint_url=config.endpoint_url,
        key=config.aws_access_key_id,
        secret=config.aws_secret_access_key,
        use_ssl=config.use_tls,
        config_kwargs={
            "connect_timeout": config.connect_timeout_s,
            "read_timeout": config.read_timeout_s,
            "max_pool_connections": config.max_inflight,
            "retries": {"mode": "standard", "total_max_attempts": 1 + config.retries},
            "s3": {"addressing_style": config.addressing_style},
            "request_checksum_calculation": "when_required",
            "response_checksum_validation": "when_required",
        },
    )
    fs.retries = 1  # one attempt per s3fs call: botocore does the retrying
    return fs


class S3Client:
    """One adapter's connection to its bucket: bounded, counted requests."""

    def __init__(self, config: S3Config, name: str) -> None:
        self.config = config
        self.name = name
        self.bucket: str = config.bucket or ""
        self.fs: s3fs.S3FileSystem | None = None
        self._slots = asyncio.Semaphore(config.max_inflight)
        self._tasks: set[asyncio.Future[Any]] = set()
        self._closing = False
        self.inflight = 0
        #: when an answer last proved the bucket exists (monotonic); None: not since the
        #: last "no such bucket"
        self._bucket_seen_at: float | None = None

    @property
    def closing(self) -> bool:
        """True once ``interrupt`` or ``close`` began: every request is refused from then."""
        return self._closing

    @property
    def endpoint(self) -> str:
        return _endpoint_label(self.config)

    async def open(self, announce: bool = True) -> None:
        """Connect and resolve the credentials; ``announce``: log where they come from (said
        by the start-up check, before what it finds; the adapter's client, opened after it,
        does not say it again)."""
        config = self.config
        fs = open_filesystem(config)
        await fs.set_session()
        self.fs = fs
        source = await self.credential_source(fs.session)
        if announce:
            log.info(
                "%s: s3://%s/%s at %s, credentials from %s",
                self.name,
                self.bucket,
                config.prefix,
                self.endpoint,
                source,
            )

    async def credential_source(self, session: aiobotocore.session.AioSession) -> str:
        """Where the credentials come from (never what they are)."""
        if self.config.aws_access_key_id is not None:
            return "the static keys in the adapter config"
        try:
            credentials = await session.get_credentials()
        except Exception as exc:  # a broken profile: requests will say so, counted
            return f"nowhere ({describe(exc)})"
        if credentials is None:
            return "nowhere: no AWS credentials found"
        method = getattr(credentials, "method", None) or "the AWS chain"
        return f"{method}{f' (profile {self.config.profile})' if self.config.profile else ''}"

    async def call(self, method: str, **kwargs: Any) -> Any:
        """One S3 API call on the bucket, bounded; raises what s3fs raises or S3RequestError."""
        return await self.bounded(lambda: self.request(method, **kwargs))

    async def request(self, method: str, **kwargs: Any) -> Any:
        """One S3 API call on the bucket, unbounded: for use inside :meth:`bounded`."""
        fs = self.fs
        if fs is None:
            raise S3RequestError("the S3 client is not open")
        try:
            answer = await fs._call_s3(method, Bucket=self.bucket, **kwargs)
        except Exception as exc:
            code = error_code(exc)
            if code == "NoSuchBucket":
                self._bucket_seen_at = None
            elif code == "NoSuchKey":  # named in a body: the bucket answered
                self.bucket_answered()
            raise
        self.bucket_answered()
        return answer

    def bucket_answered(self) -> None:
        """An answer proved the bucket exists."""
        self._bucket_seen_at = time.monotonic()

    def bucket_vouched(self) -> bool:
        """True while an answer of the last :data:`BUCKET_TRUSTED_S` proved the bucket
        exists: a HEAD's bare 404 is then a missing object."""
        seen = self._bucket_seen_at
        return seen is not None and time.monotonic() - seen < BUCKET_TRUSTED_S

    async def bounded(self, make: Callable[[], Awaitable[T]]) -> T:
        """Run one request (``make()`` and whatever it reads) within ``request_timeout_s``,
        at most ``max_inflight`` at once; ``interrupt`` fails it at once."""
        if self._closing:
            raise S3RequestError("the adapter is closing")
        timeout = self.config.request_timeout_s
        async with self._slots:
            if self._closing:  # interrupted while waiting for a slot: never start it
                raise S3RequestError("the adapter is closing")
            task = asyncio.ensure_future(asyncio.wait_for(make(), timeout))
            self._tasks.add(task)
            self.inflight += 1
            try:
                await asyncio.wait({task})
            except asyncio.CancelledError:
                task.cancel()
                raise
            finally:
                self.inflight -= 1
                self._tasks.discard(task)
        if task.cancelled():
            raise S3RequestError("the adapter is closing")
        try:
            return task.result()
        except asyncio.TimeoutError:
            raise S3RequestError(f"no complete answer within request_timeout_s={timeout:g}") from None

    def interrupt(self, loop: asyncio.AbstractEventLoop) -> None:
        """From any thread: fail requests in flight and refuse new ones (closing)."""
        self._closing = True

        def cancel_all() -> None:
            for task in list(self._tasks):
                task.cancel()

        if not loop.is_closed():
            loop.call_soon_threadsafe(cancel_all)

    async def close(self) -> None:
        fs, self.fs = self.fs, None
        if fs is not None and fs._s3 is not None:
            try:
                await fs._s3creator.__aexit__(None, None, None)
            except Exception as exc:
                log.debug("%s: closing the S3 client: %s", self.name, describe(exc))


#: S3 error codes that mean the credentials themselves are wrong, not a missing permission
_PROBE_READ_S = 5.0
BAD_CREDENTIALS = frozenset({"InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken"})
#: what botocore raises, before any request is sent, for AWS settings no request can work
#: with: a profile that is not in the shared files, a config file it cannot parse, an
#: access key id in the environment without its secret, no credentials anywhere in the
#: chain (the client resolves them once, when it is made: they never turn up later), a
#: region name no client can be made for (from AWS_DEFAULT_REGION or the config file)
_BAD_AWS_SETTINGS = (
    botocore.exceptions.InvalidRegionError,
    botocore.exceptions.ProfileNotFound,
    botocore.exceptions.ConfigParseError,
    botocore.exceptions.PartialCredentialsError,
    botocore.exceptions.NoCredentialsError,
)


#: what the start-up check's wait allows, past its two bounded steps, for closing its client
_PROBE_CLOSE_S = 5.0


class _CredentialsHang(Exception):
    """The start-up check's credentials were not resolved within ``request_timeout_s``."""


def _run_probe(probe: Callable[[], Coroutine[Any, Any, None]], outcome: list[BaseException | None]) -> None:
    """The start-up check on its own thread and event loop; ``outcome`` gets None, or what
    it raised.  A process the check started (a credential_process) still running at its
    end is killed, while the loop can still close its pipes: the check gave up on it."""
    with asyncio.Runner() as runner:
        loop = runner.get_loop()
        started: list[asyncio.SubprocessTransport] = []
        subprocess_exec = loop.subprocess_exec

        async def recorded_exec(*args: Any, **kwargs: Any) -> Any:
            transport, protocol = await subprocess_exec(*args, **kwargs)
            started.append(transport)
            return transport, protocol

        loop.subprocess_exec = recorded_exec  # type: ignore[method-assign]
        try:
            runner.run(probe())
        except BaseException as exc:
            outcome.append(exc)
        else:
            outcome.append(None)
        finally:
            for transport in started:
                transport.close()  # kills the process if it still runs
            runner.run(asyncio.sleep(0))  # the pipes' closing callbacks


def check_bucket(config: S3Config, name: str) -> bool:
    """Ask the bucket for one listed object before the adapter is built; False if the
    store did not answer.

    A bucket that does not exist, credentials the store rejects and AWS settings botocore
    cannot use (a missing profile, an unparsable config file, half a static key pair in
    the environment, no credentials at all) are configuration mistakes: a ``ConfigError``, so the server stops
    with one line -- every request would fail until a restart.  A store that does not
    answer is not: the adapter starts, its requests fail (counted) until the store is
    back, and the server serves from L1 meanwhile.  Credentials the AWS chain does not
    resolve within ``request_timeout_s`` (a credential_process that hangs) are a
    ``ConfigError`` too: every request would wait on them the same way, and so is a TLS
    handshake that fails (a service without TLS behind ``https://``, a certificate not
    trusted here): every request would fail it.
    """
    # One attempt, briefly: a store too slow to answer this is reported, not waited for.
    patience = config.connect_timeout_s + min(config.read_timeout_s, _PROBE_READ_S)
    quick = msgspec.structs.replace(
        config, retries=0, request_timeout_s=min(config.request_timeout_s, patience)
    )

    async def probe() -> None:
        client = S3Client(quick, name)
        try:
            try:
                # Resolving the credentials (a credential_process, SSO, an instance role)
                # is bounded by nothing of botocore's.
                await asyncio.wait_for(client.open(), config.request_timeout_s)
            except asyncio.TimeoutError:
                raise _CredentialsHang from None
            prefix = f"{config.prefix}/" if config.prefix else ""
            await client.call("list_objects_v2", Prefix=prefix, Delimiter="/", MaxKeys=1)
        finally:
            await client.close()

    # Both steps are bounded; the wait is too, for a provider that blocks the probe's event
    # loop.  A daemon thread: one left hanging must not hold the process's exit.
    bound = config.request_timeout_s + quick.request_timeout_s + _PROBE_CLOSE_S
    outcome: list[BaseException | None] = []
    checking = threading.Thread(
        target=_run_probe, args=(probe, outcome), name=f"l2-{name}-probe", daemon=True
    )
    checking.start()
    checking.join(bound)
    if not outcome:
        raise ConfigError(
            f"{name}: the start-up check of s3://{config.bucket}/{config.prefix} at "
            f"{_endpoint_label(config)} did not end within {bound:g} s (request_timeout_s="
            f"{config.request_timeout_s:g} twice, and the close): start-up stopped"
        )
    if outcome[0] is not None:
        try:
            raise outcome[0]
        except _CredentialsHang:
            raise ConfigError(
                f"{name}: no AWS credentials within request_timeout_s={config.request_timeout_s:g}: "
                "the credential chain (a credential_process, SSO, an instance role) did not return"
            ) from None
        except FileNotFoundError as exc:
            if error_code(exc) == "NoSuchBucket":
                raise ConfigError(
                    f"{name}: bucket {config.bucket!r} does not exist at {_endpoint_label(config)}"
                ) from exc
            raise ConfigError(
                f"{name}: cannot list s3://{config.bucket}/{config.prefix}: {describe(exc)}"
            ) from exc
        except _BAD_AWS_SETTINGS as exc:
            raise ConfigError(f"{name}: the AWS settings cannot be used: {describe(exc)}") from exc
        except PermissionError as exc:
            if error_code(exc) in BAD_CREDENTIALS:
                raise ConfigError(
                    f"{name}: {_endpoint_label(config)} refused the credentials ({describe(exc)})"
                ) from exc
            log.warning(
                "%s: listing s3://%s/%s is not allowed (%s): usage after a restart is learned on lookup",
                name,
                config.bucket,
                config.prefix,
                describe(exc),
            )
        except botocore.exceptions.SSLError as exc:
            # The service answered, not in TLS or with a certificate not trusted here:
            # every request would fail the same way until the configuration changes.
            raise ConfigError(
                f"{name}: {_endpoint_label(config)} failed the TLS handshake ({describe(exc)}): "
                "check the scheme of endpoint_url (http:// for a service without TLS; "
                "disable_tls with s3_endpoint) and that its certificate is trusted here "
                "(a private CA's PEM file in AWS_CA_BUNDLE)"
            ) from exc
        except Exception as exc:
            # A TLS-only service answers plain HTTP with a bare 400 or a closed connection,
            # which would read as one that does not answer: every request would fail so.
            endpoint = config.endpoint_url
            if not config.use_tls and endpoint and speaks_tls(endpoint, config.connect_timeout_s):
                raise ConfigError(
                    f"{name}: {endpoint} speaks TLS, not plain HTTP ({describe(exc)}): "
                    "use https:// in endpoint_url (with s3_endpoint, drop disable_tls)"
                ) from exc
            log.warning(
                "%s: %s did not answer at start-up (%s); requests fail, counted, until it does",
                name,
                _endpoint_label(config),
                describe(exc),
            )
            return False
    return True
