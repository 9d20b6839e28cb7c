"""What ``serve`` prints for people: the start-up banner and the summary at stop.

Log lines are for files and journals; these panels are for a terminal.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import TYPE_CHECKING, Any

from rich.panel import Panel
from rich.table import Table

from lmcache_tiers import __version__
from lmcache_tiers.config import config_to_builtins, redact_secrets
from lmcache_tiers.defaults import describe_default

if TYPE_CHECKING:
    from lmcache_tiers.server.app import TiersServer

__all__ = ["start_banner", "stop_summary"]


def _gib(size: float) -> str:
    return f"{size / 2**30:.2f} GiB"


def start_banner(server: TiersServer) -> Panel:
    """The start-up panel: front ends, HTTP, L1, L2, policies."""
    config = server.config
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold cyan", no_wrap=True)
    grid.add_column()
    for index, frontend in enumerate(server.frontends):
        grid.add_row("front ends" if index == 0 else "", f"{frontend.address}  {frontend.describe()}")
    http = server.http_url
    grid.add_row("HTTP", f"{http}/metrics  /healthz  /status" if http else "disabled (--metrics-port 0)")
    l1 = server.storage.l1
    pages = l1.arena.pages if l1.is_memory else None
    grid.add_row(
        "L1",
        f"{_gib(config.l1_size_bytes)}, eviction {config.eviction_policy} at "
        f"{config.eviction_trigger_watermark:.0%} frees {config.eviction_ratio:.0%}, "
        f"lock TTL {config.l1_lock_ttl_s:g}s",
    )
    if pages is not None:
        grid.add_row("", f"{l1.arena.path} on {pages.describe()}")
        hint = pages.hint()
        if hint is not None:
            grid.add_row("", hint)
    adapters = redact_secrets(config_to_builtins(config)["l2_adapters"])
    if adapters:
        for index, adapter in enumerate(adapters):
            fields = ", ".join(
                f"{k}={v}"
                for k, v in adapter.items()
                if k != "type" and v is not None and v not in ([], (), {})
            )
            grid.add_row("L2" if index == 0 else "", f"{index}: {adapter['type']}  {fields}")
            default_note = describe_default(adapter)
            if default_note is not None:
                grid.add_row("", f"   {default_note}")
    else:
        grid.add_row("L2", "none (L1 only)")
    grid.add_row(
        "policies",
        f"store {config.l2_store_policy}, prefetch {config.l2_prefetch_policy} "
        f"(at most {config.l2_prefetch_max_in_flight} in flight)",
    )
    grid.add_row("chunk size", f"{config.chunk_size} tokens")
    grid.add_row("log level", logging.getLevelName(logging.getLogger("lmcache_tiers").getEffectiveLevel()))
    grid.add_row("stop", _how_to_stop())
    return Panel(grid, title=f"lmcache-tiers {__version__}  (pid {os.getpid()})", expand=False)


def _how_to_stop() -> str:
    """How to stop this server, as it stands: a server started in a script's background
    keeps SIGINT ignored (see ``server.app.KEPT_IGNORED``), so Ctrl-C is offered only when
    it works; SIGTERM always stops it."""
    kill = f"kill {os.getpid()} (SIGTERM)"
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        return f"{kill}: drains, then flushes L2 stores; Ctrl-C is ignored (started in the background)"
    return f"Ctrl-C or {kill}: drains, then flushes L2 stores; a second Ctrl-C stops at once"


def stop_summary(summary: dict[str, Any]) -> Panel:
    """The panel printed once the server has stopped (``TiersServer.close``'s summary)."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold cyan", no_wrap=True)
    grid.add_column()
    grid.add_row("uptime", f"{summary['uptime_s']:.1f} s, {summary['requests']} requests")
    grid.add_row("stored", f"{summary['stored_chunks']} chunks, {_gib(summary['stored_bytes'])}")
    grid.add_row("retrieved", f"{summary['retrieved_chunks']} chunks, {_gib(summary['retrieved_bytes'])}")
    grid.add_row(
        "lookups",
        f"{summary['lookups']}, hit chunks L1 {summary['l1_hit_chunks']} / L2 {summary['l2_hit_chunks']}",
    )
    grid.add_row("failures", str(summary["failures"]))
    grid.add_row(
        "released",
        f"{summary['client_locks_released']} client locks, "
        f"{summary['client_reservations_aborted']} unfinished stores aborted",
    )
    if summary["l2_flushed"]:
        flushed = "all flushed"
    else:
        abandoned_by = summary["l2_flush_abandoned_by"]
        why = f"abandoned on {abandoned_by}" if abandoned_by else "flush timed out"
        flushed = f"{why}, {summary['l2_objects_abandoned']} objects not stored in L2"
    grid.add_row("L2 stores", f"{summary['l2_stores_pending']} pending at stop, {flushed}")
    return Panel(grid, title="lmcache-tiers stopped", expand=False)
