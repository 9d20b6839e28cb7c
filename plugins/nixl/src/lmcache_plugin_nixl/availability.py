"""Checks that a NIXL backend can run here, made before any NIXL call that could hang.

Creating the GDS or GDS_MT backend on a machine without CUDA's cuFile, the NVIDIA driver
or a GPU can block inside the plugin instead of failing, so those prerequisites are
looked up first with plain library and device probes (``ctypes.util.find_library`` does
not load anything).  Plugins missing from the NIXL build (HF3FS is not in the PyPI wheel)
or unable to load their own libraries are found through the agent's plugin list and
plugin parameters, which only ``dlopen`` the plugin and return an error when that fails.
"""

from __future__ import annotations

import ctypes.util
import glob
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

from lmcache_plugin_nixl.config import connection_string_fields
from lmcache_tiers.plugin import BackendUnavailableError, FieldError, direct_io_refusal

#: Backends that go through NVIDIA GPUDirect Storage and so need cuFile and a GPU.
CUFILE_BACKENDS: frozenset[str] = frozenset({"GDS", "GDS_MT"})


def _gpu_device_present() -> bool:
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def check_native_prerequisites(
    backend: str,
    find_library: Callable[[str], str | None] = ctypes.util.find_library,
    gpu_present: Callable[[], bool] = _gpu_device_present,
) -> None:
    """Raise BackendUnavailableError naming the first missing piece a backend needs."""
    if backend not in CUFILE_BACKENDS:
        return
    if find_library("cufile") is None:
        raise BackendUnavailableError(
            f"NIXL backend {backend} needs NVIDIA cuFile (libcufile, CUDA's GPUDirect Storage "
            "library), which is not installed on this machine"
        )
    if find_library("cuda") is None:
        raise BackendUnavailableError(
            f"NIXL backend {backend} needs the NVIDIA driver library libcuda, which is not "
            "installed on this machine"
        )
    if not gpu_present():
        raise BackendUnavailableError(
            f"NIXL backend {backend} needs an NVIDIA GPU, and no /dev/nvidia* device exists"
        )


#: how long the start-up reachability probe of a remote object store waits
ENDPOINT_PROBE_TIMEOUT_S = 5.0


def azure_blob_endpoint(params: dict[str, str]) -> tuple[str, str]:
    """(URL of the blob service, the backend_params key it came from) for AZURE_BLOB."""
    url = params.get("account_url", "").strip()
    if url:
        return url, "account_url"
    fields = connection_string_fields(params.get("connection_string", ""))
    if fields.get("BlobEndpoint"):
        return fields["BlobEndpoint"], "connection_string"
    protocol = fields.get("DefaultEndpointsProtocol", "https")
    suffix = fields.get("EndpointSuffix", "core.windows.net")
    return f"{protocol}://{fields.get('AccountName', '')}.blob.{suffix}", "connection_string"


#: region the AWS SDK falls back to when neither backend_params nor the environment names one
AWS_DEFAULT_REGION = "us-east-1"


def aws_s3_endpoint(params: dict[str, str], environ: Mapping[str, str] = os.environ) -> str:
    """URL of AWS's own S3 endpoint for the configured region (``region``, else
    ``AWS_REGION`` or ``AWS_DEFAULT_REGION``, else us-east-1), where the SDK sends requests
    when no ``endpoint_override`` is given."""
    region = (
        params.get("region", "").strip()
        or environ.get("AWS_REGION", "").strip()
        or environ.get("AWS_DEFAULT_REGION", "").strip()
        or AWS_DEFAULT_REGION
    )
    domain = "amazonaws.com.cn" if region.startswith("cn-") else "amazonaws.com"
    return f"{params.get('scheme', '').strip() or 'https'}://s3.{region}.{domain}"


def obj_endpoint(params: dict[str, str], environ: Mapping[str, str] = os.environ) -> tuple[str, str]:
    """(URL of the S3 service, the backend_params key naming it) for OBJ: the
    ``endpoint_override``, else AWS's own endpoint of the region (``region``)."""
    url = params.get("endpoint_override", "").strip()
    if not url:
        return aws_s3_endpoint(params, environ), "region"
    if "://" not in url:  # a bare host[:port]: the SDK puts `scheme` (https by default) first
        url = f"{params.get('scheme', '').strip() or 'https'}://{url}"
    return url, "endpoint_override"


#: resolves a host and port the way ``socket.getaddrinfo`` does (a test injects one that hangs)
Resolver = Callable[[str, int], list[tuple[Any, ...]]]


def _getaddrinfo(host: str, port: int) -> list[tuple[Any, ...]]:
    return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)


def connect_within(host: str, port: int, timeout: float, resolve: Resolver = _getaddrinfo) -> None:
    """Open (and close) a TCP connection to ``host:port`` within ``timeout`` seconds, the
    name lookup included: ``socket.create_connection``'s timeout does not cover
    ``getaddrinfo``, which blocks as long as the resolver does (a DNS server that does not
    answer: tens of seconds of retries).  The lookup runs on a daemon thread given up on at
    the deadline; it ends on its own when the resolver does."""
    deadline = time.monotonic() + timeout
    outcome: list[list[tuple[Any, ...]] | OSError] = []
    resolved = threading.Event()

    def lookup() -> None:
        try:
            outcome.append(resolve(host, port))
        except OSError as exc:
            outcome.append(exc)
        except ValueError as exc:
            # getaddrinfo raises UnicodeError for a name IDNA cannot encode (an empty label,
            # one over 63 characters) and ValueError for a NUL in it: the name is the fault.
            outcome.append(OSError(f"{host!r} is not a valid host name ({exc})"))
        finally:
            resolved.set()

    threading.Thread(target=lookup, name="nixl-endpoint-lookup", daemon=True).start()
    if not resolved.wait(timeout) or not outcome:
        raise TimeoutError(f"the name {host} did not resolve within {timeout:g} s")
    answer = outcome[0]
    if isinstance(answer, OSError):
        raise answer
    error: OSError = OSError(f"the name {host} resolved to no address")
    for family, kind, proto, _name, address in answer:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"no connection to {host}:{port} within {timeout:g} s")
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(remaining)
            sock.connect(address)
            return
        except OSError as exc:
            error = exc
        finally:
            sock.close()
    raise error


def proxy_variable(scheme: str, host: str, environ: Mapping[str, str]) -> str | None:
    """The proxy variable (``HTTPS_PROXY``, ``ALL_PROXY``, either case) that botocore and
    curl would send a request to ``scheme://host`` through, None when there is none or
    ``NO_PROXY`` exempts the host.  NIXL's OBJ backend uses none of them, so the start-up
    probe does not either (it connects as the backend will); this only names one in the
    refusal, for whoever expected it to apply."""
    no_proxy = environ.get("no_proxy") or environ.get("NO_PROXY") or ""
    for entry in (part.strip().lower() for part in no_proxy.split(",")):
        entry = entry.lstrip(".")
        if entry == "*" or (entry and (host.lower() == entry or host.lower().endswith("." + entry))):
            return None
    for name in (f"{scheme}_proxy", "all_proxy"):
        for variant in (name, name.upper()):
            if environ.get(variant, "").strip():
                return variant
    return None


def check_before_l1(backend: str, init_params: dict[str, str]) -> None:
    """What creating ``backend`` needs that neither NIXL nor L1 does: its native libraries
    and device, and its remote service reachable.  The adapters' pre-flight runs it, so
    that a server refuses such a config before it allocates (and pre-faults) L1 and loads
    NIXL, not seconds later; creating the backend checks it again, for callers that run
    no pre-flight."""
    check_native_prerequisites(backend)
    check_remote_endpoint(backend, init_params)


def check_remote_endpoint(
    backend: str,
    params: dict[str, str],
    timeout: float = ENDPOINT_PROBE_TIMEOUT_S,
    environ: Mapping[str, str] = os.environ,
    resolve: Resolver = _getaddrinfo,
) -> None:
    """Refuse to start an AZURE_BLOB or OBJ adapter whose service cannot be reached.

    NIXL creates the backend and registers objects without contacting the service, so an
    unreachable endpoint would otherwise show up only as failed stores and misses (for
    OBJ, each after the SDK's retries, tens of seconds).  A TCP connection to the
    endpoint's host and port is the probe (no request is sent), the name lookup included
    in ``timeout``; it goes to the endpoint directly, never through a proxy, because the
    NIXL OBJ backend does: the AWS SDK for C++ ignores ``HTTPS_PROXY`` and the like unless
    ``allowSystemProxy`` is set, and NIXL sets neither it nor a proxy.  OBJ without an
    ``endpoint_override`` probes AWS's own endpoint of its region, which a host without a
    route to AWS cannot reach either (each store failed after about 26 s of the SDK's
    retries with a bare NIXL_ERR_BACKEND, while the server ran).  OBJ without a bucket
    (``bucket``, or ``AWS_DEFAULT_BUCKET``) is refused by name: NIXL would fail with a bare
    NIXL_ERR_BACKEND.
    """
    if backend == "OBJ":
        if not params.get("bucket", "").strip() and not environ.get("AWS_DEFAULT_BUCKET"):
            raise FieldError(
                "backend_params.bucket",
                "backend_params.bucket is required for the OBJ backend "
                "(or the AWS_DEFAULT_BUCKET environment variable): the bucket holding the pool",
            )
        url, key = obj_endpoint(params, environ)
    elif backend == "AZURE_BLOB":
        url, key = azure_blob_endpoint(params)
    else:
        return
    parts = urlsplit(url)
    host = parts.hostname or ""
    try:
        port = parts.port or (80 if parts.scheme == "http" else 443)
    except ValueError:
        host = ""
    # FieldErrors, so that start-up names the adapter and the key's path, as it does for
    # the configuration's own refusals.
    if not host:
        raise FieldError(
            f"backend_params.{key}",
            f"backend_params.{key}: {url!r} is not a URL with a host name ({backend})",
        )
    try:
        connect_within(host, port, timeout, resolve)
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        hint = ""
        proxy = proxy_variable(parts.scheme or "https", host, environ) if backend == "OBJ" else None
        if proxy is not None:
            hint = (
                f"; {proxy} is set, but NIXL's OBJ backend does not use proxies (the AWS SDK "
                "for C++ leaves allowSystemProxy off and NIXL sets no proxy): the endpoint "
                "must be reachable directly"
            )
        advice = f"check backend_params.{key} and that the service is up"
        if key == "region":
            advice = (
                "with no backend_params.endpoint_override this is AWS's own endpoint of the "
                "region; give endpoint_override for another S3 service, or a route to AWS"
            )
        raise FieldError(
            f"backend_params.{key}",
            f"{backend} endpoint {url} ({host}:{port}) cannot be reached: {reason}; {advice}{hint}",
        ) from None


def describe_missing_plugin(backend: str, available: list[str], nixl_module: str) -> str:
    """One line saying that this NIXL build lacks ``backend``'s plugin."""
    extra = ""
    if backend == "HF3FS":
        extra = " (the PyPI wheels do not include it; HF3FS needs NIXL built with 3FS support)"
    listing = ", ".join(sorted(available)) or "none"
    return (
        f"NIXL backend {backend} is not available: {nixl_module} has no {backend} plugin"
        f"{extra}; plugins found: {listing}"
    )


def check_direct_io(directory: str) -> None:
    """Refuse ``use_direct_io`` on a filesystem that cannot move files with O_DIRECT: found
    at start-up with a probe file, rather than as EINVAL on every store later."""
    refusal = direct_io_refusal(directory)
    if refusal is not None:
        raise FieldError(
            "backend_params.use_direct_io",
            f'use_direct_io is "true" but the filesystem of {directory} does not support '
            f'O_DIRECT ({refusal}); set it to "false"',
        )
