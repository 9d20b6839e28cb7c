"""plugin_code() and awaiting_plugin_code(): which exceptions escaping plugin code become
a PluginBaseException (the plugin's failure, for the caller's ``except Exception``) and
which go through as they are, on the main thread and off it.  One shared, stateless
context manager serves every caller: nested and concurrent uses must not interfere."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from lmcache_tiers.errors import PluginBaseException, awaiting_plugin_code, plugin_code


class PluginsOwnBaseException(BaseException):
    """A BaseException subclass of a plugin's own."""


CONVERTED, AS_RAISED = "converted", "as raised"

# (what the plugin raises, on the main thread, off it) for synchronous plugin code: a
# CancelledError there is the plugin's own (core's are thrown in at an await only), and
# off the main thread so is every BaseException -- no signal is raised there.
SYNCHRONOUS = [
    (ValueError, AS_RAISED, AS_RAISED),
    (StopIteration, AS_RAISED, AS_RAISED),
    (KeyboardInterrupt, AS_RAISED, CONVERTED),
    (SystemExit, AS_RAISED, CONVERTED),
    (PluginsOwnBaseException, AS_RAISED, CONVERTED),
    (GeneratorExit, AS_RAISED, CONVERTED),
    (asyncio.CancelledError, AS_RAISED, CONVERTED),
]

# The same for code that awaits: a CancelledError is core's cancellation and a
# GeneratorExit Python closing the coroutine, both let through on any thread.
AWAITING = [
    (ValueError, AS_RAISED, AS_RAISED),
    (KeyboardInterrupt, AS_RAISED, CONVERTED),
    (SystemExit, AS_RAISED, CONVERTED),
    (PluginsOwnBaseException, AS_RAISED, CONVERTED),
    (GeneratorExit, AS_RAISED, AS_RAISED),
    (asyncio.CancelledError, AS_RAISED, AS_RAISED),
]


def outcome(guard: Callable[[], contextlib.AbstractContextManager[None]], kind: type[BaseException]) -> str:
    """What leaves ``with guard():`` when its body raises ``kind``, checked for shape."""
    raised = kind("from the plugin")
    try:
        with guard():
            raise raised
    except PluginBaseException as exc:
        assert exc.original is raised and exc.__cause__ is raised and exc.__suppress_context__
        return CONVERTED
    except BaseException as exc:
        assert exc is raised
        return AS_RAISED
    raise AssertionError("nothing left the block")


def off_the_main_thread(call: Callable[[], str]) -> str:
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(call).result()


@pytest.mark.parametrize(("guard", "table"), [(plugin_code, SYNCHRONOUS), (awaiting_plugin_code, AWAITING)])
def test_what_is_taken_for_the_plugins_failure(
    guard: Callable[[], contextlib.AbstractContextManager[None]],
    table: list[tuple[type[BaseException], str, str]],
) -> None:
    assert threading.current_thread() is threading.main_thread()
    for kind, on_main, off_main in table:
        assert outcome(guard, kind) == on_main, kind
        assert off_the_main_thread(functools.partial(outcome, guard, kind)) == off_main, kind


def test_nothing_raised_leaves_the_block_as_usual() -> None:
    ran = []
    with plugin_code():
        ran.append(True)
    assert ran == [True]


def test_nested_uses_of_the_shared_guard_convert_once() -> None:
    """The outer guard sees the inner one's PluginBaseException, an Exception: let through."""

    def nested() -> str:
        with plugin_code(), plugin_code():  # the inner guard converts, the outer lets through
            raise SystemExit(3)

    with pytest.raises(PluginBaseException) as caught:
        off_the_main_thread(nested)
    assert isinstance(caught.value.original, SystemExit)
    assert not isinstance(caught.value.__cause__, PluginBaseException)


def test_concurrent_uses_of_the_shared_guard_do_not_mix() -> None:
    """Threads raising different things through the one instance at once each get their own."""
    start = threading.Barrier(8)

    def raise_own(index: int) -> BaseException:
        start.wait()
        try:
            with plugin_code():
                raise (PluginsOwnBaseException if index % 2 else ValueError)(index)
        except BaseException as exc:
            return exc
        raise AssertionError("nothing left the block")

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(raise_own, range(8)))
    for index, exc in enumerate(results):
        if index % 2:
            assert isinstance(exc, PluginBaseException) and exc.original.args == (index,)
        else:
            assert type(exc) is ValueError and exc.args == (index,)
