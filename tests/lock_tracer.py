"""Test-only lock-order and blocking-under-lock tracer, loaded as a pytest plugin.

``python -m pytest -p lock_tracer ...`` (with tests/ on ``sys.path``) replaces
``threading.Lock``, ``threading.RLock`` and ``threading.Condition`` for the run.  Locks
created by the project's modules (see ``_TRACED_PREFIXES``) come back wrapped and named by
their creation site; every other caller (the standard library, third-party code) gets the
real primitive, so nothing outside the project pays for the tracing.

Per thread the tracer keeps the stack of traced locks held.  Taking lock B while holding A
records the edge A -> B with the call site.  At the end of the run it reports:

* inversions: a pair of locks taken in both orders (A -> B somewhere, B -> A elsewhere),
  which two threads can turn into a deadlock;
* blocking calls (sleep, Event/Condition wait, Thread.join, socket and zmq send/recv,
  open/read/write/fsync, L2 adapter calls) made while holding a traced lock.

The report is written to the path in ``LOCK_TRACER_REPORT`` (JSON) when set, and a summary
is printed.  Production code never imports this module.
"""

from __future__ import annotations

import builtins
import itertools
import json
import os
import socket
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

_TRACED_PREFIXES = (
    "lmcache_tiers.l1",
    "lmcache_tiers.l2",
    "lmcache_tiers.controllers",
    "lmcache_tiers.storage",
    "lmcache_tiers.server",
    "lmcache_tiers.wire",
    "lmcache_tiers.router",
    "lmcache_tiers.activity",
    "lmcache_tiers.burst",
    "lmcache_tiers.close_steps",
    "lmcache_plugin_frontend_native",
)
#: frames from these files are skipped when naming a lock's creation site or a call site
_OWN_FILES = (__file__, threading.__file__)

#: the standard library's and installed packages' frames are left out of call sites
_LIBRARY_DIRS = tuple(
    {sysconfig.get_paths()[name] for name in ("stdlib", "platstdlib", "purelib", "platlib")}
)

_real_lock = threading.Lock
_real_rlock = threading.RLock
_real_condition = threading.Condition

_held = threading.local()
_record_lock = _real_lock()
#: (first, second) -> one call site where second was taken while first was held
_edges: dict[tuple[str, str], str] = {}
#: (lock held, blocking call) -> one call site
_blocking: dict[tuple[str, str], str] = {}


def _held_stack() -> list[str]:
    stack = getattr(_held, "stack", None)
    if stack is None:
        stack = _held.stack = []
    return stack


def _caller_module(depth: int) -> str:
    frame = sys._getframe(depth)
    return str(frame.f_globals.get("__name__", ""))


def _is_traced_module(name: str) -> bool:
    return name.startswith(_TRACED_PREFIXES)


def _project_site(limit: int = 6) -> str:
    """The innermost project frames of the current stack, innermost last."""
    frames = [
        f
        for f in traceback.extract_stack()[:-1]
        if f.filename not in _OWN_FILES and not f.filename.startswith((*_LIBRARY_DIRS, "<frozen"))
    ]
    return " <- ".join(
        f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}" for f in reversed(frames[-limit:])
    )


def _creation_name() -> str:
    """The creation site, and the class of the object whose method created the lock: one
    site (a base class's ``__init__``) makes locks for several classes, which take other
    locks in different orders."""
    frame: Any = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename in _OWN_FILES:
        frame = frame.f_back
    if frame is None:
        return "?"
    site = f"{frame.f_code.co_filename.split('/src/')[-1]}:{frame.f_lineno}"
    owner = frame.f_locals.get("self")
    return site if owner is None else f"{site}({type(owner).__name__})"


def _note_acquired(name: str) -> None:
    stack = _held_stack()
    new_edges = [(held, name) for held in dict.fromkeys(stack) if held != name]
    if new_edges:
        with _record_lock:
            missing = [e for e in new_edges if e not in _edges]
        if missing:
            site = _project_site()
            with _record_lock:
                for edge in missing:
                    _edges.setdefault(edge, site)
    stack.append(name)


def _note_released(name: str) -> None:
    stack = _held_stack()
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] == name:
            del stack[i]
            return


def note_blocking(call: str, *, ignore: str | None = None) -> None:
    """Record ``call`` against every traced lock the current thread holds."""
    stack = getattr(_held, "stack", None)
    if not stack:
        return
    held = [n for n in dict.fromkeys(stack) if n != ignore]
    if not held:
        return
    with _record_lock:
        missing = [(n, call) for n in held if (n, call) not in _blocking]
    if missing:
        site = _project_site()
        with _record_lock:
            for key in missing:
                _blocking.setdefault(key, site)


class TracedLock:
    """A Lock or RLock that reports its acquisitions and releases to the tracer."""

    def __init__(self, inner: Any, name: str) -> None:
        self._inner = inner
        self.name = name

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = bool(self._inner.acquire(blocking, timeout))
        if got:
            _note_acquired(self.name)
        return got

    def release(self) -> None:
        _note_released(self.name)
        self._inner.release()

    __enter__ = acquire

    def __exit__(self, *exc: object) -> None:
        self.release()

    def locked(self) -> bool:
        return bool(self._inner.locked())

    # Condition uses these when the lock has them (RLock): keep the held stack in step.
    def _is_owned(self) -> bool:
        owned = getattr(self._inner, "_is_owned", None)
        if owned is not None:
            return bool(owned())
        if self._inner.acquire(False):
            self._inner.release()
            return False
        return True

    def _release_save(self) -> Any:
        stack = _held_stack()
        depth = stack.count(self.name)
        for _ in range(depth):
            _note_released(self.name)
        save = getattr(self._inner, "_release_save", None)
        state = save() if save is not None else self._inner.release()
        return (state, depth)

    def _acquire_restore(self, saved: Any) -> None:
        state, depth = saved
        restore = getattr(self._inner, "_acquire_restore", None)
        if restore is not None:
            restore(state)
        else:
            self._inner.acquire()
        for _ in range(max(depth, 1)):
            _note_acquired(self.name)

    def _at_fork_reinit(self) -> None:
        self._inner._at_fork_reinit()


class TracedCondition(_real_condition):  # type: ignore[misc,valid-type]
    """A Condition whose wait counts as blocking for every other lock the thread holds."""

    def wait(self, timeout: float | None = None) -> bool:
        note_blocking("Condition.wait", ignore=getattr(self._lock, "name", None))
        return bool(super().wait(timeout))


def _lock_factory() -> Any:
    if _is_traced_module(_caller_module(2)):
        return TracedLock(_real_lock(), _creation_name())
    return _real_lock()


def _rlock_factory(*args: Any, **kwargs: Any) -> Any:
    if _is_traced_module(_caller_module(2)):
        return TracedLock(_real_rlock(), _creation_name())
    return _real_rlock(*args, **kwargs)


def _condition_factory(lock: Any = None) -> Any:
    if not _is_traced_module(_caller_module(2)):
        return _real_condition(lock)
    if lock is None:
        lock = TracedLock(_real_rlock(), _creation_name())
    return TracedCondition(lock)


def _short_wait_callers() -> set[Any]:
    """Standard-library callers whose "blocking" call cannot block for long: Thread.start
    waits for the new thread to run its first line, and asyncio wakes its loop with a send
    on a non-blocking self-pipe."""
    import asyncio.selector_events

    return {
        threading.Thread.start.__code__,
        asyncio.selector_events.BaseSelectorEventLoop._write_to_self.__code__,
    }


def _blocking_wrapper(real: Callable[..., Any], call: str) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if sys._getframe(1).f_code not in _SHORT_WAIT_CALLERS:
            note_blocking(call)
        return real(*args, **kwargs)

    wrapper.__wrapped__ = real  # type: ignore[attr-defined]
    return wrapper


def _zmq_wrapper(real: Callable[..., Any], call: str) -> Callable[..., Any]:
    """zmq send/recv: blocking unless flags say NOBLOCK (then it raises rather than waits)."""
    import zmq

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        flags = kwargs.get("flags", args[1] if len(args) > 1 and call.startswith("zmq.send") else 0)
        if call.startswith("zmq.recv"):
            flags = kwargs.get("flags", args[0] if args else 0)
        if not (isinstance(flags, int) and flags & zmq.NOBLOCK):
            note_blocking(call)
        return real(self, *args, **kwargs)

    return wrapper


def _fd_wrapper(real: Callable[..., Any], call: str) -> Callable[..., Any]:
    """os.read/os.write: blocking unless the descriptor is non-blocking (an eventfd waker)."""

    def wrapper(fd: int, *args: Any) -> Any:
        try:
            blocking = os.get_blocking(fd)
        except OSError:
            blocking = True  # the call itself reports the bad descriptor
        if blocking:
            note_blocking(call)
        return real(fd, *args)

    return wrapper


_SHORT_WAIT_CALLERS = _short_wait_callers()
_patched: list[tuple[Any, str, Any]] = []


def _patch(owner: Any, attr: str, new: Any) -> None:
    _patched.append((owner, attr, getattr(owner, attr)))
    setattr(owner, attr, new)


def _patch_blocking(owner: Any, attr: str, call: str) -> None:
    real = getattr(owner, attr, None)
    if real is not None:
        _patch(owner, attr, _blocking_wrapper(real, call))


def _patch_adapter_calls() -> None:
    from lmcache_tiers.l2 import interface

    for attr in ("submit_store", "submit_lookup_and_lock", "submit_load", "submit_delete"):
        if hasattr(interface.L2Adapter, attr):
            _patch_blocking(interface.L2Adapter, attr, f"L2Adapter.{attr}")


def install() -> None:
    _patch(threading, "Lock", _lock_factory)
    _patch(threading, "RLock", _rlock_factory)
    _patch(threading, "Condition", _condition_factory)
    _patch_blocking(time, "sleep", "time.sleep")
    _patch_blocking(threading.Event, "wait", "Event.wait")
    _patch_blocking(threading.Thread, "join", "Thread.join")
    for attr in ("send", "sendall", "recv", "recv_into", "sendmsg", "recvmsg", "connect", "accept"):
        _patch_blocking(socket.socket, attr, f"socket.{attr}")
    for attr in ("read", "write"):
        _patch(os, attr, _fd_wrapper(getattr(os, attr), f"os.{attr}"))
    for attr in ("pread", "pwrite", "preadv", "pwritev", "fsync", "fdatasync"):
        _patch_blocking(os, attr, f"os.{attr}")
    _patch_blocking(builtins, "open", "open")
    try:
        import zmq
    except ImportError:
        pass
    else:
        for attr in ("send", "recv", "send_multipart", "recv_multipart"):
            _patch(zmq.Socket, attr, _zmq_wrapper(getattr(zmq.Socket, attr), f"zmq.{attr}"))
    _patch_adapter_calls()


def uninstall() -> None:
    while _patched:
        owner, attr, real = _patched.pop()
        setattr(owner, attr, real)


def _path(graph: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    previous: dict[str, str | None] = {start: None}
    queue = [start]
    while queue:
        node = queue.pop(0)
        if node == goal:
            path: list[str] = []
            at: str | None = node
            while at is not None:
                path.append(at)
                at = previous[at]
            return path[::-1]
        for following in sorted(graph.get(node, ())):
            if following not in previous:
                previous[following] = node
                queue.append(following)
    return None


def inversions() -> list[dict[str, Any]]:
    """Each cycle in the lock-order graph once: two locks taken in both orders, or a longer
    ring (A before B, B before C, C before A) that three threads can deadlock on."""
    with _record_lock:
        edges = dict(_edges)
    graph: dict[str, set[str]] = {}
    for first, second in edges:
        graph.setdefault(first, set()).add(second)
    found: list[dict[str, Any]] = []
    seen: set[frozenset[str]] = set()
    for first, second in sorted(edges):
        back = _path(graph, second, first)
        if back is None or frozenset(back) in seen:
            continue
        seen.add(frozenset(back))
        ring = [first, *back]
        found.append(
            {
                "locks": " -> ".join(ring),
                "sites": [edges[(a, b)] for a, b in itertools.pairwise(ring)],
            }
        )
    return found


def report() -> dict[str, Any]:
    with _record_lock:
        blocking = [{"held": h, "call": c, "site": s} for (h, c), s in sorted(_blocking.items())]
        edges = [{"first": a, "then": b, "site": s} for (a, b), s in sorted(_edges.items())]
    return {"inversions": inversions(), "blocking_under_lock": blocking, "edges": edges}


# -- pytest plugin hooks -------------------------------------------------------------------


# Installed on import (``-p lock_tracer`` imports it before any conftest or project module)
# so that module-level locks and dataclass default factories are traced too.
install()


def pytest_unconfigure(config: Any) -> None:
    uninstall()
    result = report()
    path = os.environ.get("LOCK_TRACER_REPORT")
    if path:
        with open(path, "w") as out:
            json.dump(result, out, indent=1)
    print(
        f"\nlock tracer: {len(result['edges'])} lock orders, "
        f"{len(result['inversions'])} inversions, "
        f"{len(result['blocking_under_lock'])} blocking calls under a lock"
    )
    for inv in result["inversions"]:
        print(f"  INVERSION {inv['locks']}")
        for site in inv["sites"]:
            print(f"    {site}")
