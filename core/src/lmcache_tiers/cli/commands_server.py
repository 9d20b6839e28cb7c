"""Commands that talk to a running server: ``status`` and ``bench``.

Plain functions with typer-annotated parameters; the CLI app registers them.  Heavy
imports (zmq, numpy) happen inside the functions so ``--help`` stays fast.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer
from rich.markup import escape
from rich.table import Table

from lmcache_tiers.cli.output import EXIT_USAGE, fail, stdout
from lmcache_tiers.endpoints import check_server_url
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.strict_json import strict_json
from lmcache_tiers.wire.protocol import MAX_OBJECT_BYTES, MAX_TOKEN_LEN

if TYPE_CHECKING:
    from lmcache_tiers.server.benchmark import BenchResult

DEFAULT_URL = "tcp://127.0.0.1:5555"
#: the longest wait for one reply a command takes (ZeroMQ's receive timeout is an int of ms)
MAX_TIMEOUT_S = 86400.0
#: the largest object the protocol carries, in MiB
MAX_CHUNK_MIB = float(MAX_OBJECT_BYTES >> 20)


def server_url(value: str | None) -> str | None:
    """``--url`` callback: an endpoint a client cannot connect to is a usage error."""
    if value is None:
        return None
    try:
        return check_server_url(value)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from None


def client_token(value: str | None) -> str | None:
    """``--auth-token`` callback: a token no server can hold is a usage error, found before
    a connection is tried (the value itself is never quoted)."""
    if value is None:
        return None
    if len(value) > MAX_TOKEN_LEN:
        raise typer.BadParameter(
            f"the token is {len(value)} characters long; the protocol carries at most {MAX_TOKEN_LEN}"
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        # a byte of the command line or environment that is no UTF-8 arrives as a lone surrogate
        raise typer.BadParameter("the token is not UTF-8 text") from None
    if "\0" in value:
        raise typer.BadParameter("the token holds a NUL character")
    return value


UrlOption = Annotated[
    str,
    typer.Option("--url", callback=server_url, help="Server endpoint (tcp://host:port or ipc://path)."),
]
TokenOption = Annotated[
    Optional[str],
    typer.Option(
        "--auth-token",
        envvar="LMCACHE_TIERS_AUTH_TOKEN",
        callback=client_token,
        help="Token, if the server requires one. \\[default: none]",
    ),
]
#: the help of --timeout where a command waits for a server that does not answer yet
WAIT_TIMEOUT_HELP = (
    "Seconds to wait for each reply, and for a server that is not up yet to answer "
    "(a note on stderr says so meanwhile)."
)
WaitTimeoutOption = Annotated[
    float, typer.Option("--timeout", min=0.01, max=MAX_TIMEOUT_S, help=WAIT_TIMEOUT_HELP)
]


def status(
    url: UrlOption = DEFAULT_URL,
    as_json: Annotated[bool, typer.Option("--json", help="Print the raw status document as JSON.")] = False,
    auth_token: TokenOption = None,
    timeout: WaitTimeoutOption = 5.0,
) -> None:
    """Show a running server's state: L1, L2 adapters, requests, in-flight work, failures."""
    from lmcache_tiers.cli.connect import wait_for_server
    from lmcache_tiers.client import Client, ClientError

    try:
        wait_for_server(url, timeout=timeout, auth_token=auth_token)
        with Client(url, auth_token=auth_token, timeout=timeout, name="status") as client:
            document = client.status()
    except ClientError as exc:
        fail(f"cannot get the status of {url}: {exc}", 1)
    if as_json:
        # strict JSON, as HTTP /status writes it: a backend's NaN or infinite stat is null
        typer.echo(strict_json(document, indent=2))
        return
    for table in status_tables(document):
        stdout.print(table)


def _number(value: Any) -> float | None:
    """``value`` as a finite number, or None: a plugin-built adapter answers its usage and
    used bytes itself, and a null, NaN or text there must cost that cell, not the command."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _gib(value: Any) -> str:
    number = _number(value)
    return "?" if number is None else f"{number / 2**30:.2f} GiB"


def _pct(value: Any) -> str:
    if value is None:
        return "n/a"
    number = _number(value)
    if number is None:
        return "?"
    return "n/a" if number < 0 else f"{number:.1%}"


def _text(value: Any) -> str:
    """A value of the server's document as a table cell: adapter errors, names and failure
    reasons are the server's (and its plugins') text, not rich markup -- a "[/x]" in an
    error would otherwise end the command with a MarkupError, half the tables printed."""
    return escape(str(value))


def _adapter_state(adapter: dict[str, Any]) -> str:
    """``ok``, the error its status read met, or ``circuit open`` while its breaker keeps the
    backend from being called (the adapter answers misses and refusals meanwhile)."""
    if "error" in adapter:
        return _text(adapter["error"])
    backend = adapter.get("backend")
    if isinstance(backend, dict) and backend.get("circuit_open"):
        return "circuit open"
    return "ok"


def _failed_plugins(failed: Any) -> str:
    """``name (error), ...``: the plugins a server started without; ``none`` when it has all,
    ``?`` from a server too old to say."""
    if failed is None:
        return "?"
    # an error's text is the plugin's, not rich markup: "[x]" in it is printed as it is
    return escape(", ".join(f"{name} ({error})" for name, error in failed.items())) or "none"


def _stale_segments(names: Any) -> str:
    """The leftover L1 segments this server's start-up removed (or kept); ``none`` when it
    found none, ``?`` from a server too old to say."""
    if names is None:
        return "?"
    # file names under /dev/shm are anyone's to choose, not rich markup
    return escape(", ".join(str(name) for name in names)) or "none"


def status_tables(document: dict[str, Any]) -> list[Table]:
    """The status document as rich tables (server and L1, L2 adapters, failures)."""
    server, l1, requests = document.get("server", {}), document.get("l1", {}), document.get("requests", {})
    overview = Table(title="lmcache-tiers server", show_header=False, title_justify="left")
    overview.add_column(style="bold cyan", no_wrap=True)
    overview.add_column()
    endpoints = server.get("endpoints") or [server.get("endpoint")]
    overview.add_row("endpoints", _text(", ".join(str(endpoint) for endpoint in endpoints)))
    overview.add_row("state", "draining (stopping)" if server.get("draining") else "serving")
    overview.add_row("version", _text(f"{server.get('version')} (protocol {server.get('protocol_version')})"))
    overview.add_row(
        "pid / uptime", _text(f"{server.get('pid')} / {_number(server.get('uptime_s', 0)) or 0:.0f} s")
    )
    overview.add_row("shared memory", _text(server.get("shm_segment") or "off (inline only)"))
    overview.add_row("clients", str(server.get("clients", 0)))
    overview.add_row(
        "L1",
        f"{_gib(l1.get('used_bytes', 0))} of {_gib(l1.get('capacity_bytes', 0))} "
        f"({_pct(l1.get('usage', 0))}), {l1.get('objects', 0)} objects, "
        f"{l1.get('read_locks', 0)} read locks, {l1.get('write_locked', 0)} being written",
    )
    overview.add_row(
        "lookups",
        f"{requests.get('lookups', 0)}, hit chunks L1 {requests.get('l1_hit_chunks', 0)} "
        f"/ L2 {requests.get('l2_hit_chunks', 0)}",
    )
    overview.add_row(
        "stores / retrieves",
        f"{server.get('store_chunks', 0)} chunks ({_gib(server.get('store_bytes', 0))}) / "
        f"{server.get('retrieve_chunks', 0)} chunks ({_gib(server.get('retrieve_bytes', 0))})",
    )
    prefetch, store = document.get("prefetch", {}), document.get("store", {})
    overview.add_row(
        "in flight",
        f"prefetches {prefetch.get('in_flight', 0)} (+{prefetch.get('queued', 0)} queued), "
        f"L2 stores {store.get('in_flight_tasks', 0)} (+{store.get('pending_batches', 0)} batches)",
    )
    evicted = document.get("eviction", {}).get("l1", {})
    overview.add_row(
        "L1 evictions", _text(f"{evicted.get('evicted_keys', 0)} objects ({evicted.get('policy', '?')})")
    )
    overview.add_row("plugins failed to load", _failed_plugins(server.get("plugins_failed_to_load")))
    overview.add_row("L1 stale segments removed", _stale_segments(server.get("l1_stale_segments_removed")))
    overview.add_row("L1 stale segments kept", _stale_segments(server.get("l1_stale_segments_kept")))
    tables = [overview]

    adapters = document.get("adapters", [])
    if adapters:
        l2 = Table(title="L2 adapters", title_justify="left")
        for column in ("adapter", "usage", "used", "stored", "loaded", "evicted", "state"):
            l2.add_column(column, justify="left" if column in ("adapter", "state") else "right")
        for adapter in adapters:
            l2.add_row(
                _text(adapter.get("name")),
                _pct(adapter.get("usage")),
                _gib(adapter.get("used_bytes")),  # unread (an error): "?", not an empty adapter
                str(adapter.get("keys_stored", 0)),
                str(adapter.get("keys_loaded", 0)),
                str(adapter.get("keys_evicted", 0)),
                _adapter_state(adapter),
            )
        tables.append(l2)

    # The storage and the front ends may count the same reason: summed, as in /metrics.
    failures: dict[str, Any] = dict(document.get("failures", {}))
    for reason, count in server.get("failures", {}).items():
        failures[reason] = failures.get(reason, 0) + count
    if failures:
        failed = Table(title="failures", title_justify="left")
        failed.add_column("reason")
        failed.add_column("count", justify="right")
        for reason, count in sorted(failures.items()):
            failed.add_row(_text(reason), _text(count))
        tables.append(failed)
    return tables


def bench(
    url: UrlOption = DEFAULT_URL,
    chunks: Annotated[int, typer.Option(min=1, help="Chunks per STORE/RETRIEVE batch.")] = 64,
    chunk_mib: Annotated[
        float, typer.Option(min=0.001, max=MAX_CHUNK_MIB, help="Size of each chunk in MiB.")
    ] = 2.0,
    repeats: Annotated[int, typer.Option(min=1, help="Timed repetitions (the median is reported).")] = 5,
    lookup_keys: Annotated[int, typer.Option(min=1, help="Keys per LOOKUP request.")] = 16,
    lookup_requests: Annotated[int, typer.Option(min=1, help="LOOKUP requests to time.")] = 20_000,
    inline: Annotated[bool, typer.Option(help="Also measure inline (socket) transfers.")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print the figures as JSON.")] = False,
    auth_token: TokenOption = None,
    timeout: WaitTimeoutOption = 60.0,
) -> None:
    """Store and retrieve chunks through a running server and time it against memcpy.

    Safe on a server in production: the chunks use a cache salt of their own, are kept in
    L1 only (never written to L2) and are deleted when the run ends.  L1 needs room for
    one batch (chunks x chunk-mib); engines' L1 objects may be evicted to make it.  This
    process holds the batch twice (the chunks, and the buffers they are retrieved into); a
    batch larger than the server's L1 or than the memory available here is refused first.
    """
    from lmcache_tiers.cli.connect import wait_for_server
    from lmcache_tiers.client import ClientError
    from lmcache_tiers.server.benchmark import BenchSizeError

    try:
        wait_for_server(url, timeout=timeout, auth_token=auth_token)
        result = run_with_progress(
            url,
            chunks=chunks,
            chunk_bytes=max(1, int(chunk_mib * (1 << 20))),
            repeats=repeats,
            lookup_keys=lookup_keys,
            lookup_requests=lookup_requests,
            inline=inline,
            auth_token=auth_token,
            timeout=timeout,
            show=not as_json,
        )
    except BenchSizeError as exc:
        fail(
            f"--chunks {chunks} x --chunk-mib {chunk_mib:g}: {exc}; lower --chunks or --chunk-mib", EXIT_USAGE
        )
    except (ClientError, RuntimeError) as exc:
        fail(f"benchmark of {url} failed: {exc}", 1)
    if as_json:
        typer.echo(strict_json(result.to_dict(), indent=2))
    else:
        stdout.print(bench_table(result))


def run_with_progress(url: str, *, show: bool = True, **options: Any) -> BenchResult:
    """``run_bench`` with a rich progress bar (``show=False``: silent)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from lmcache_tiers.server.benchmark import run_bench, steps_for

    progress = Progress(
        TextColumn("{task.description:<18}"),
        BarColumn(),
        TimeElapsedColumn(),
        transient=True,
        console=stdout,
        # off a terminal a transient bar cannot erase itself: it would leave a blank line
        # before the figures, or before a refusal's one line, in a file or a pipe
        disable=not show or not stdout.is_terminal,
        # few redraws: the drawing thread competes with the timed requests for the GIL
        refresh_per_second=2,
    )
    total = steps_for(
        options.get("repeats", 5), options.get("inline", True), options.get("lookup_requests", 20_000)
    )
    with progress:
        task = progress.add_task("bench", total=total)
        return run_bench(
            url, step=lambda label: progress.update(task, advance=1, description=label), **options
        )


def bench_table(result: BenchResult) -> Table:
    size = f"{result.chunks} x {result.chunk_bytes / (1 << 20):g} MiB"
    table = Table(title=f"lmcache-tiers bench: {size}, median of {result.repeats}", title_justify="left")
    table.add_column("measurement")
    table.add_column("value", justify="right")
    table.add_column("vs memcpy (same run)", justify="right")
    table.add_row("memcpy", f"{result.memcpy_gbps:.2f} GB/s", "1.00")
    for label, value in (
        ("STORE (shared memory)", result.store_gbps),
        ("RETRIEVE (shared memory)", result.retrieve_gbps),
        ("STORE (inline)", result.inline_store_gbps),
        ("RETRIEVE (inline)", result.inline_retrieve_gbps),
    ):
        if value is not None:
            ratio = result.ratio(value)
            table.add_row(label, f"{value:.2f} GB/s", f"{ratio:.2f}" if ratio is not None else "")
    keys = f"{result.lookup_keys} keys"
    table.add_row(f"LOOKUP p50 ({keys})", f"{result.lookup_p50_us:.0f} us", "")
    table.add_row(f"LOOKUP p99 ({keys})", f"{result.lookup_p99_us:.0f} us", "")
    table.add_row("LOOKUP requests/s (1 client, sequential)", f"{result.lookup_per_s:,.0f}", "")
    table.add_row(
        f"LOOKUP requests/s (1 client, {result.lookup_window} in flight)",
        f"{result.lookup_pipelined_per_s:,.0f}",
        "",
    )
    table.add_row("PING p50", f"{result.ping_p50_us:.0f} us", "")
    table.add_row(
        f"objects stored L1-only and removed (salt {result.cache_salt})", str(result.objects_removed), ""
    )
    if result.notes:
        table.caption = "; ".join(result.notes)
    return table
