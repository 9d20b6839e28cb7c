"""Exception types shared by every part of lmcache-tiers.

Each carries a message an operator can act on; the CLI prints it as one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Literal, TypeVar

T = TypeVar("T")


class TiersError(Exception):
    """Base class of every error lmcache-tiers raises on purpose."""


class ConfigError(TiersError):
    """Configuration is invalid (bad JSON, unknown name, wrong type, out of range)."""


class SettingRefused(ConfigError):
    """A value of one ServerConfig setting that cannot be served.  The message names the
    setting by its config key (``l1_shm_dir relative: give an absolute path``), which is
    right for a ``--config`` file and for a config built in code; ``serve`` names the flag
    or the environment variable instead when the value came from one (``with_name``)."""

    def __init__(self, setting: str, value: object, reason: str) -> None:
        self.setting = setting
        self.value = value
        self.reason = reason
        super().__init__(self._naming(setting))

    def _naming(self, name: str) -> str:
        return f"{name} {self.value}: {self.reason}"

    def with_name(self, name: str) -> ConfigError:
        """The same refusal naming the setting as ``name`` (a flag, a variable)."""
        return ConfigError(self._naming(name))


class PluginError(TiersError):
    """A plugin failed to load or registered something invalid or conflicting."""


class ComponentLoadError(PluginError):
    """A component's implementation could not be imported (e.g. a missing dependency)."""


class BackendUnavailableError(TiersError):
    """A configured backend cannot run on this machine (missing library or device)."""


class KeyValidationError(TiersError, ValueError):
    """An ObjectKey field is unsafe or out of bounds."""


class L1OutOfMemoryError(TiersError):
    """L1 cannot hold a whole batch right now; nothing of the batch was reserved."""


class PartialFailure(TiersError):
    """Raised by an L2 backend's batch method whose call failed part-way -- a cluster node
    or host that did not answer while the others did their keys -- with ``results``, the
    per-key answer the method would return (done keys True, the failed node's False).

    Core takes ``results`` as the call's answer, so keys already stored or removed are
    accounted as such, and counts the call as failed (``backend_errors``, the circuit
    breaker's failures): a backend that answers "part failed" by returning alone is never
    seen by the breaker, and every later call pays the failed node's timeout again.

    For stores, loads and deletes only: a lookup (``contains_many``) raising it fails as
    a whole (every key a miss), since its None would say "absent" of keys the failed part
    never answered for, and core would release objects still stored.
    """

    def __init__(self, results: object, reason: str) -> None:
        super().__init__(reason)
        self.results = results


class PluginBaseException(Exception):
    """A KeyboardInterrupt, SystemExit or other ``BaseException`` (not an ``Exception``)
    that plugin code raised off the main thread, carried as an ``Exception`` so that core's
    handlers of a plugin's failures count and log it like any other (see
    :func:`plugin_code`).  ``original`` is what the plugin raised."""

    def __init__(self, original: BaseException) -> None:
        self.original = original
        super().__init__(f"{type(original).__name__}: {original}")


def raised_by_a_plugin(exc: BaseException) -> bool:
    """Whether ``exc``, no ``Exception``, escaped plugin code as the plugin's own failure.

    KeyboardInterrupt and SystemExit come from a signal or ``sys.exit`` only on the main
    thread; plugin code also runs on core's worker threads, event loops and controller
    threads, where they (or a BaseException subclass of the plugin's) can only be the
    plugin's.  Let through, one would end that thread -- every later call it serves left
    waiting -- so it is the plugin's failure instead.  On the main thread it may be the
    operator's Ctrl-C and goes on up; a ``CancelledError`` is asyncio's and goes on too."""
    if isinstance(exc, (Exception, asyncio.CancelledError)):
        return False
    return threading.current_thread() is not threading.main_thread()


def _raised_by_synchronous_plugin_code(exc: BaseException) -> bool:
    """:func:`raised_by_a_plugin` for plugin code that awaits nothing: there a
    ``CancelledError`` is the plugin's too (a client library that runs and cancels
    coroutines of its own), since core's cancellations are thrown in at an ``await``."""
    if isinstance(exc, asyncio.CancelledError):
        return threading.current_thread() is not threading.main_thread()
    return raised_by_a_plugin(exc)


def _raised_by_awaiting_plugin_code(exc: BaseException) -> bool:
    """:func:`raised_by_a_plugin` for plugin code that awaits: a ``CancelledError`` thrown
    in at its ``await`` is core's cancellation, and a ``GeneratorExit`` is Python closing
    the coroutine; both must go through as they are."""
    return not isinstance(exc, GeneratorExit) and raised_by_a_plugin(exc)


class _PluginCode:
    """The context manager :func:`plugin_code` (and :func:`awaiting_plugin_code`) returns.
    A class, not a generator: every lookup passes through one (the L1 eviction policy told
    of its hits), and entering and leaving a ``contextlib.contextmanager`` costs about a
    microsecond.  Holds only which exceptions it takes for the plugin's, so one instance
    serves every caller and thread."""

    __slots__ = ("_raised_by_the_plugin",)

    def __init__(self, raised_by_the_plugin: Callable[[BaseException], bool]) -> None:
        self._raised_by_the_plugin = raised_by_the_plugin

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, traceback: object
    ) -> Literal[False]:
        if exc is None or not self._raised_by_the_plugin(exc):
            return False  # nothing raised, or raised as it is
        raise PluginBaseException(exc) from exc


_PLUGIN_CODE = _PluginCode(_raised_by_synchronous_plugin_code)
_AWAITING_PLUGIN_CODE = _PluginCode(_raised_by_awaiting_plugin_code)


def plugin_code() -> contextlib.AbstractContextManager[None]:
    """Run synchronous plugin code (a policy's call; no ``await`` inside) so that what
    only the plugin can have raised off the main thread surfaces as a
    :class:`PluginBaseException`, for the caller's ``except Exception``."""
    return _PLUGIN_CODE


def awaiting_plugin_code() -> contextlib.AbstractContextManager[None]:
    """:func:`plugin_code` for plugin code that awaits (a coroutine backend's ``open`` or
    listing, on the adapter's event loop): a ``CancelledError`` or ``GeneratorExit`` goes
    through as it is -- the task cancelled or closed, not failed with the plugin's error."""
    return _AWAITING_PLUGIN_CODE


def plugin_walk(keys: Iterable[T]) -> Iterator[T]:
    """``keys`` (a policy's ``victims()``) with each step taken as under :func:`plugin_code`,
    and nothing else: the caller's own handling runs between the steps, and closing the
    walk early is not mistaken for the policy's failure.  The walk runs under the L1 lock,
    a step for each key: a plain ``try`` guards it, where entering and leaving
    :func:`plugin_code` would add three calls a key."""
    with plugin_code():
        iterator = iter(keys)
    while True:
        try:
            key = next(iterator)
        except StopIteration:
            return
        except BaseException as exc:
            if not _raised_by_synchronous_plugin_code(exc):
                raise
            raise PluginBaseException(exc) from exc
        yield key
