"""Progress of the adapters' start-up scans on the server console.

A scan that is still running a second after start-up gets a progress display: a rich
progress bar per adapter (objects and bytes accounted so far, and the rate) when the
console is a terminal, otherwise one log line every few seconds, so journals show it too.
The display ends when every scan has finished; the scans themselves never wait for it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn

from lmcache_tiers.l2.interface import L2Adapter

log = logging.getLogger("lmcache_tiers.l2")

#: a scan shorter than this shows nothing
SHOW_AFTER_S = 1.0
#: log lines of a console that is not a terminal, at most one per adapter this often
LOG_EVERY_S = 5.0


def _scanning(adapters: Sequence[L2Adapter]) -> list[tuple[L2Adapter, dict[str, int]]]:
    found = []
    for adapter in adapters:
        try:
            stats = adapter.stats()
        except Exception:  # a broken adapter's stats are its own problem, not the display's
            continue
        if stats.get("scan_running"):
            found.append((adapter, stats))
    return found


def _describe(stats: dict[str, int], elapsed: float) -> str:
    keys, size = stats.get("scan_keys", 0), stats.get("scan_bytes", 0)
    rate = keys / elapsed if elapsed > 0 else 0.0
    return f"{keys:,} objects, {size / 2**30:.2f} GiB ({rate:,.0f} objects/s)"


def watch_scans(adapters: Sequence[L2Adapter], console: Console, *, poll_s: float = 0.25) -> threading.Thread:
    """Start the display thread (a daemon); returns it so tests can join it."""
    started = time.monotonic()

    def run() -> None:
        time.sleep(SHOW_AFTER_S)
        if not _scanning(adapters):
            return
        if console.is_terminal:
            _bars(adapters, console, started, poll_s)
        else:
            _log_lines(adapters, started, poll_s)

    thread = threading.Thread(target=run, name="l2-scan-progress", daemon=True)
    thread.start()
    return thread


def _bars(adapters: Sequence[L2Adapter], console: Console, started: float, poll_s: float) -> None:
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TextColumn("{task.fields[detail]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        tasks: dict[str, TaskID] = {}
        while True:
            running = _scanning(adapters)
            elapsed = time.monotonic() - started
            for adapter, stats in running:
                if adapter.name not in tasks:
                    tasks[adapter.name] = progress.add_task(
                        f"{adapter.name}: start-up scan", total=None, detail=""
                    )
                progress.update(tasks[adapter.name], detail=_describe(stats, elapsed))
            for name, task in tasks.items():
                if name not in {adapter.name for adapter, _ in running}:
                    progress.update(task, detail="done", total=1, completed=1)
            if not running:
                return
            time.sleep(poll_s)


def _log_lines(adapters: Sequence[L2Adapter], started: float, poll_s: float) -> None:
    last = 0.0
    while running := _scanning(adapters):
        now = time.monotonic()
        if now - last >= LOG_EVERY_S or not last:
            last = now
            for adapter, stats in running:
                log.info("%s: start-up scan: %s so far", adapter.name, _describe(stats, now - started))
        time.sleep(poll_s)
