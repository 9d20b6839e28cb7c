"""Calling a backend method: one result per key, of the right kind, or the batch fails."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from lmcache_tiers.errors import PartialFailure, raised_by_a_plugin
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2.state import AdapterState
from lmcache_tiers.protocols import ObjectSize

#: what a backend must define; the rest of the protocol is optional
REQUIRED_METHODS = ("put_many", "contains_many", "get_many_into", "delete_many", "list_keys", "capacity")
#: the batch methods, all coroutine functions or none
BATCH_METHODS = ("put_many", "contains_many", "get_many_into", "delete_many")


class NotCalled(Exception):
    """Raised in place of a backend call that was not made (the open circuit breaker): the
    batch fails as if the call had, but it is neither counted nor logged as a failure.

    A refused lookup must not answer "absent": core would take every accounted key it
    asked about for removed behind its back and release it.
    """


def optional_method(backend: object, name: str) -> Callable[..., Any] | None:
    """A backend's optional member ``name`` when it is callable (``open``, ``ping`` ...)."""
    method = getattr(backend, name, None)
    return method if callable(method) else None


def missing_methods(backend: object) -> list[str]:
    return [name for name in REQUIRED_METHODS if not callable(getattr(backend, name, None))]


def is_async_backend(backend: object) -> bool:
    """Whether the batch methods are coroutine functions (all of them, or a TypeError)."""
    flags = [inspect.iscoroutinefunction(getattr(backend, name)) for name in BATCH_METHODS]
    if any(flags) and not all(flags):
        mixed = ", ".join(
            f"{name}={'async' if flag else 'sync'}" for name, flag in zip(BATCH_METHODS, flags, strict=True)
        )
        raise TypeError(f"{type(backend).__name__} mixes coroutine and plain batch methods ({mixed})")
    return all(flags)


def _valid_found(item: Any) -> bool:
    if item is None or isinstance(item, ObjectSize):
        return item is None or (item.stored >= 0 and item.l1 >= 0)
    return isinstance(item, int) and not isinstance(item, bool) and item >= 0


def _valid_outcome(item: Any) -> bool:
    # Only a boolean is an answer: a count of bytes read or written (a short read is
    # still a positive number) or any other truthy object would pass for success.
    return isinstance(item, (bool, np.bool_))


def checked(method: str, result: Any, expected: int) -> list[Any]:
    """``result`` as a list, or ValueError when it cannot be trusted for ``expected`` keys."""
    if isinstance(result, (Mapping, str, bytes, bytearray, memoryview)):
        # Iterating these yields keys or characters, not one answer per key in order.
        raise ValueError(f"{method} returned a {type(result).__name__}, not one result per key")
    items = list(result)
    if len(items) != expected:
        raise ValueError(f"{method} returned {len(items)} results for {expected} keys")
    if method == "contains_many":
        if not all(_valid_found(item) for item in items):
            raise ValueError(f"{method} returned something other than a size, ObjectSize or None")
    elif not all(_valid_outcome(item) for item in items):
        raise ValueError(f"{method} returned something other than True or False")
    return items


def partly_failed(state: AdapterState, method: str, exc: PartialFailure, expected: int) -> list[Any] | None:
    """The answer a call that failed part-way carried (:class:`PartialFailure`): counted as
    a failed call (the circuit breaker, wrapping the backend, has counted it already), its
    per-key results taken like a returned answer -- or the whole batch failed when they
    cannot be trusted.

    A lookup's (``contains_many``) results are never taken: its None says "absent", and
    for the keys of the part that failed it can only mean "not answered" -- taken, core
    would release the bytes of accounted objects still stored and announce them gone.
    The lookup fails instead (every key a miss, none forgotten), as a refused one does."""
    state.backend_failed(method, exc)
    if method == "contains_many":
        return None
    try:
        return checked(method, exc.results, expected)
    except (TypeError, ValueError):
        return None


def call(
    state: AdapterState, backend: object, method: str, keys: list[ObjectKey], *args: Sequence[memoryview]
) -> list[Any] | None:
    """Run one synchronous backend method; None when it raised, answered wrongly or was
    not called (:class:`NotCalled`)."""
    if not keys:
        return []
    try:
        return checked(method, getattr(backend, method)(keys, *args), len(keys))
    except NotCalled:
        return None
    except PartialFailure as exc:
        return partly_failed(state, method, exc, len(keys))
    except (Exception, asyncio.CancelledError) as exc:
        # A plain method running coroutines of its own may raise CancelledError (no
        # Exception): nothing here cancels it, so it is the backend's failure.
        state.backend_failed(method, exc)
        return None
    except BaseException as exc:
        if not raised_by_a_plugin(exc):
            raise
        state.backend_failed(method, exc)
        return None


def cancelled_from_outside(closing: bool) -> bool:
    """Whether a ``CancelledError`` caught in the running task is a cancellation of that
    task (the adapter closing), not one the backend raised of its own accord (a client
    library that cancelled its own request).  ``closing``: whether the adapter is closing,
    the only time core cancels a call, which decides where tasks do not count their
    cancellations (before Python 3.11)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    if cancelling is not None:
        return bool(cancelling())
    return closing


async def call_async(
    state: AdapterState, backend: object, method: str, keys: list[ObjectKey], *args: Sequence[memoryview]
) -> list[Any] | None:
    """``call`` for a coroutine method."""
    if not keys:
        return []
    try:
        return checked(method, await getattr(backend, method)(keys, *args), len(keys))
    except NotCalled:
        return None
    except PartialFailure as exc:
        return partly_failed(state, method, exc, len(keys))
    except Exception as exc:
        state.backend_failed(method, exc)
        return None
    except asyncio.CancelledError as exc:
        if cancelled_from_outside(state.closing.is_set()):
            raise  # close cancels the task: the runner undoes what it holds
        # The backend's own (nobody cancelled this task): a failed call, as in ``call``.
        state.backend_failed(method, exc)
        return None
    except GeneratorExit:
        # Thrown in by Python closing this coroutine as it awaits the backend (a task
        # dropped with its event loop): the close, not a failure, and it must go through.
        raise
    except BaseException as exc:
        if not raised_by_a_plugin(exc):
            raise
        state.backend_failed(method, exc)
        return None
