"""LMCache ``lmcache server`` flags that ``lmcache-tiers serve`` does not take as options.

Operators bring command lines from LMCache's multi-process server.  Flags whose feature
exists here are real ``serve`` options with the same names and meanings (see
``serve_cmd``).  A few ask for what lmcache-tiers does anyway (``--transport zmq``) and are
accepted for those values only.  The rest belong to features that do not exist here; they
are refused with one line saying so, instead of "No such option".  docs/lmcache-compat.md
has the whole table, and a test checks it against this module and the reference's flags.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import typer

_NO_COORDINATOR = "servers are standalone here: there is no MP coordinator"
_NO_P2P = "there is no peer-to-peer transfer between servers"
_NO_WORKERS = (
    "there are no worker pools: one RPC loop answers requests and background controllers move L2 data"
)
_NO_BLEND = "CacheBlend is not part of lmcache-tiers"
_PLUGINS = (
    "extensions are pip-installed plugins (entry-point group lmcache_tiers; `lmcache-tiers plugins list`)"
)


def _lmcache_mp_option(field: str) -> str:
    """Why a session flag is refused: the setting exists, on the front end of LMCache's clients."""
    return (
        "the native protocol registers no workers or sessions (a client that disappears has its "
        "read locks expire after --l1-read-ttl-seconds); for LMCache's clients it is an option of "
        f'the lmcache_mp front end: --frontend \'{{"type": "lmcache_mp", "{field}": SECONDS}}\''
    )


_OBSERVABILITY = (
    "observability is the Prometheus /metrics endpoint (--metrics-port) and plain log lines; "
    "there is no event bus or OpenTelemetry export"
)
_NO_THROUGHPUT_LOG = "there is no periodic throughput log; read /metrics or `lmcache-tiers status`"
_NO_REPORT = "serve prints only its banner, log lines and a summary; read /metrics or `lmcache-tiers status`"

#: reference flag -> why lmcache-tiers refuses it
REFUSED: dict[str, str] = {
    "--instance-id": _NO_COORDINATOR,
    "--null-block-id": "the native protocol names chunks by key, never by engine block id",
    "--max-workers": _NO_WORKERS,
    "--max-gpu-workers": _NO_WORKERS,
    "--max-cpu-workers": _NO_WORKERS,
    "--grpc-server-workers": "there is no gRPC transport (ZeroMQ only)",
    "--runtime-plugin-locations": _PLUGINS,
    "--runtime-plugin-config": _PLUGINS,
    "--server-module": _PLUGINS,
    "--script-allowed-imports": "there is no /run_script endpoint",
    "--worker-reap-timeout-seconds": _lmcache_mp_option("worker_reap_timeout_s"),
    "--session-ttl-seconds": _lmcache_mp_option("session_ttl_s"),
    "--worker-registration-grace-seconds": _lmcache_mp_option("worker_registration_grace_s"),
    "--enable-segmented-prefix": _NO_BLEND,
    "--enable-dedup-content": _NO_BLEND,
    "--enable-blend-reorder": _NO_BLEND,
    "--enable": "there are no experimental transfer modules",
    "--kv-event-log-size": "there is no KV-event channel",
    "--p2p-advertise-url": _NO_P2P,
    "--p2p-listen-url": _NO_P2P,
    "--p2p-lookup-timeout": _NO_P2P,
    "--p2p-load-timeout": _NO_P2P,
    "--p2p-transfer-engine": _NO_P2P,
    "--l1-manager": (
        "L1 is one arena, in memory (--l1-size-gb) or in an NVMe file (--gds-l1-path); "
        "there are no tagged L1 managers"
    ),
    "--l1-devdax-path": "L1 lives in memory (--l1-size-gb) or in an NVMe file (--gds-l1-path) only",
    "--periodic-notifier-interval-ms": "controllers wake on eventfds, not on a periodic notifier",
    "--disable-observability": _OBSERVABILITY,
    "--disable-grpc-metrics": "there is no gRPC transport (ZeroMQ only)",
    "--disable-logging": "log lines are filtered with LMCACHE_LOG_LEVEL (e.g. ERROR)",
    "--enable-tracing": _OBSERVABILITY,
    "--otlp-endpoint": _OBSERVABILITY,
    "--event-bus-queue-size": _OBSERVABILITY,
    "--metrics-sample-rate": "every request is counted; there are no sampled lifecycle histograms",
    "--lookup-hash-log-dir": "there is no lookup hash log",
    "--lookup-hash-log-rotation-interval": "there is no lookup hash log",
    "--lookup-hash-log-rotation-max-size": "there is no lookup hash log",
    "--lookup-hash-log-max-files": "there is no lookup hash log",
    "--enable-gc-monitor": "there is no garbage-collection monitor",
    "--gc-monitor-min-pause-ms": "there is no garbage-collection monitor",
    "--gc-monitor-top-objects": "there is no garbage-collection monitor",
    "--enable-extra-logging": _NO_THROUGHPUT_LOG,
    "--extra-logging-interval": _NO_THROUGHPUT_LOG,
    "--trace-level": "there is no operation trace recording",
    "--trace-output": "there is no operation trace recording",
    "--coordinator-url": _NO_COORDINATOR,
    "--coordinator-advertise-ip": _NO_COORDINATOR,
    "--coordinator-heartbeat-interval": _NO_COORDINATOR,
    "--coordinator-event-reporting": _NO_COORDINATOR,
    "--coordinator-event-flush-interval": _NO_COORDINATOR,
    "--coordinator-event-transport": _NO_COORDINATOR,
    "--coordinator-kafka-bootstrap-servers": _NO_COORDINATOR,
    "--coordinator-kafka-topic": _NO_COORDINATOR,
    "--coordinator-kafka-delivery-timeout": _NO_COORDINATOR,
    "--coordinator-blend-timeout": _NO_COORDINATOR,
    "--coordinator-blend-match-concurrency": _NO_COORDINATOR,
    "--format": _NO_REPORT,
    "--output": _NO_REPORT,
    "-q": _NO_REPORT,
    "--quiet": _NO_REPORT,
}


def refusal(option: str) -> str | None:
    """The one-line refusal of a reference flag lmcache-tiers does not take, else None."""
    reason = REFUSED.get(option)
    if reason is None:
        return None
    return f"{option} (an LMCache server flag) is not supported: {reason}; remove it (docs/lmcache-compat.md)"


# -- flags accepted for the values that ask for what lmcache-tiers does ------------------------

#: reference flag -> (accepted values, why other values are refused)
VALUE_CHECKED: dict[str, tuple[tuple[str, ...], str]] = {
    "--transport": (("zmq",), "there is no gRPC transport; the server speaks ZeroMQ (tcp:// or ipc://)"),
    "--hash-algorithm": (
        ("blake3",),
        "chunk keys are chained blake3 hashes, LMCache's default; builtin and sha256_cbor are not available",
    ),
    "--engine-type": (("default",), _NO_BLEND),
    "--supported-transfer-mode": (
        ("engine_driven", "auto"),
        "the server never copies from engine memory: clients copy into the L1 shared-memory "
        "segment themselves (engine-driven) or send bytes inline",
    ),
    "--gds-l1-backend": (
        ("auto",),
        "the NVMe L1 reads and writes host memory with POSIX I/O (O_DIRECT with "
        "--gds-l1-use-direct-io); there is no GPUDirect backend to choose",
    ),
}

#: reference on/off flags whose "on" asks for a feature lmcache-tiers does not have
SWITCHES_REFUSED_ON: dict[str, str] = {
    "--l1-use-hugepages": "L1 is not allocated from the hugepage pool",
    "--run-script-api-enabled": "there is no /run_script endpoint",
    "--separate-object-groups": (
        "object groups come from each key's object_group, set by the client; the server does not split them"
    ),
}


def value_check(allowed: Collection[str], reason: str) -> Callable[[Any], Any]:
    """A typer callback accepting the ``allowed`` values and refusing others with ``reason``."""

    def check(value: Any) -> Any:
        if value is not None and value not in allowed:
            raise typer.BadParameter(f"{value!r} is not available: {reason}; accepted: {', '.join(allowed)}")
        return value

    return check


def switch_check(reason: str) -> Callable[[Any], Any]:
    """A typer callback accepting the ``--no-...`` side of an on/off flag and refusing the other."""

    def check(value: Any) -> Any:
        if value:
            raise typer.BadParameter(f"lmcache-tiers does not have it: {reason}")
        return value

    return check
