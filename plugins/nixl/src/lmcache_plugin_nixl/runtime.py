"""The process-wide NIXL agent shared by every NIXL adapter, and batched transfers on it.

One agent per process: NIXL binds each backend plugin once per agent, and the two adapter
types (and several instances of them) share the backends they have in common.  The agent
runs in strict thread-sync mode because the L2 controllers call adapters from several
threads; without NIXL's progress thread (which would busy-poll a core) the caller polls its
own transfers.  Only one NIXL wheel can be loaded per process (their bindings collide), so
the module is chosen once: ``LMCACHE_NIXL_MODULE`` when set, else NIXL's own CUDA-based
pick -- except where NIXL has no CUDA stack to go by and would take the CUDA 13 wheel,
whose OBJ plugin needs CUDA's cuObject client: there the CUDA 12 wheel, whose OBJ plugin
loads without it, serves every backend (see :func:`default_module`).
"""

from __future__ import annotations

import ast
import ctypes.util
import importlib
import importlib.util
import logging
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt

from lmcache_plugin_nixl.availability import check_before_l1, describe_missing_plugin
from lmcache_tiers.plugin import BackendUnavailableError, FieldError, TiersError

log = logging.getLogger(__name__)

#: Environment variable naming the NIXL API module, e.g. ``nixl_cu12._api``.
NIXL_MODULE_ENV = "LMCACHE_NIXL_MODULE"
_DEFAULT_MODULE = "nixl._api"

#: A transfer still running after this long is reported stuck (logged again after each
#: further period) and still waited for: NIXL cannot cancel a request the kernel is working
#: on (releasing its handle does not stop the I/O), so its memory is not given back before
#: it ends -- late bytes would land in whatever owns that memory next.
TRANSFER_TIMEOUT_S = 300.0
# Polls spin this many times before sleeping: small transfers finish within microseconds,
# large ones would otherwise burn a core while the disk works.
_SPIN_POLLS = 200
_MAX_SLEEP_S = 0.0005
# Write-back waits neither spin nor poll that often: each poll takes the GIL from whatever
# request thread holds it (a 32 MiB O_DIRECT write lasts tens of ms: 200 spins and a poll
# every 0.5 ms were a few hundred GIL hand-offs per write), and a store finishing a
# millisecond or two later costs no client anything.
_BACKGROUND_FIRST_SLEEP_S = 0.0001
_BACKGROUND_MAX_SLEEP_S = 0.002

Descriptors = npt.NDArray[np.uint64]


class NixlTransferError(TiersError):
    """A NIXL transfer could not be created, posted or completed."""


class OverdueTransfers:
    """One adapter's transfers past ``TRANSFER_TIMEOUT_S``, for its ``stats()``: how many
    ever were (``transfers_past_deadline``, a counter) and how many are waiting past it
    now (``transfers_stuck``, a gauge to alert on).  A stalled device keeps its transfer
    waiting for good (see ``TRANSFER_TIMEOUT_S``); the log says so, and these let /metrics
    say so too."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._past_deadline = 0
        self._stuck = 0

    def missed(self) -> None:
        """A transfer passed its first deadline (once per transfer)."""
        with self._lock:
            self._past_deadline += 1
            self._stuck += 1

    def ended(self) -> None:
        """A transfer that had passed its deadline ended (however it ended)."""
        with self._lock:
            self._stuck -= 1

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"transfers_past_deadline": self._past_deadline, "transfers_stuck": self._stuck}


def descriptors(rows: Sequence[tuple[int, int, int]]) -> Descriptors:
    """An Nx3 (address or offset, length, device id or fd) array, NIXL's compact form."""
    array = np.empty((len(rows), 3), dtype=np.uint64)
    for index, row in enumerate(rows):
        array[index] = row
    return array


def default_module() -> tuple[str, str]:
    """The NIXL module to load when ``LMCACHE_NIXL_MODULE`` is unset, and why.

    With no CUDA stack in the process (a CPU-only host), NIXL takes whichever wheel comes
    first, the CUDA 13 one; its OBJ plugin links ``libcuobjclient`` (CUDA 13 cuObject),
    which such a host lacks, while the CUDA 12 wheel's OBJ plugin does not.  Without a GPU
    the two wheels are otherwise alike (GDS needs a GPU either way), so the CUDA 12 wheel is
    taken there and OBJ works with no setting.  With a CUDA stack, NIXL's pick stands.
    """
    try:
        from nixl_meta_utils import detect_cuda_major
    except ImportError:
        return _DEFAULT_MODULE, "NIXL's own pick"
    installed = {name for name in ("nixl_cu13", "nixl_cu12") if importlib.util.find_spec(name) is not None}
    if (
        installed == {"nixl_cu13", "nixl_cu12"}
        and (_cpu_only_torch_not_loaded() or detect_cuda_major() is None)
        and ctypes.util.find_library("cuobjclient") is None
    ):
        return "nixl_cu12._api", "no CUDA stack here, and the CUDA 13 wheel's OBJ plugin needs libcuobjclient"
    return _DEFAULT_MODULE, "NIXL's own pick"


#: the modules through which a process may have a CUDA stack loaded, which
#: ``detect_cuda_major`` asks before anything else
_CUDA_MODULES = ("torch", "cuda.bindings", "cupy")


def _cpu_only_torch_not_loaded() -> bool:
    """Whether no CUDA module is loaded and the installed torch is a build without CUDA,
    told by its version file, read as text.

    ``detect_cuda_major`` finds that same file naming no CUDA and then, as its last resort,
    imports torch to ask again: a second or more of CPU at every start of a NIXL adapter
    (torch is otherwise never imported here), for the answer the file gave.  When this
    says True, that detection ends in None."""
    if any(name in sys.modules for name in _CUDA_MODULES):
        return False
    try:
        spec = importlib.util.find_spec("torch")  # finds the package without importing it
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.origin:
        return False
    try:
        tree = ast.parse((Path(spec.origin).parent / "version.py").read_text())
    except (OSError, SyntaxError, ValueError):
        return False
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if any(isinstance(target, ast.Name) and target.id == "cuda" for target in targets):
            return isinstance(value, ast.Constant) and value.value is None
    return False


class Registration:
    """Memory or storage registered with one backend; release it exactly once."""

    def __init__(self, runtime: NixlRuntime, descs: Any, backend: str) -> None:
        self._runtime = runtime
        self._descs = descs
        self._backend = backend
        self._released = False

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        try:
            self._runtime.agent.deregister_memory(self._descs, backends=[self._backend])
        except Exception as exc:
            log.warning("NIXL deregistration on %s failed: %s", self._backend, exc)

    def __enter__(self) -> Registration:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class NixlRuntime:
    """The NIXL agent, its backends and the transfer loop."""

    _shared: NixlRuntime | None = None
    _shared_lock = threading.Lock()

    def __init__(self, api: ModuleType, module_name: str) -> None:
        self.api = api
        self.module_name = module_name
        config = api.nixl_agent_config(
            enable_prog_thread=False,
            enable_listen_thread=False,
            backends=[],
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        name = f"lmcache-tiers-{os.getpid()}-{secrets.token_hex(3)}"
        try:
            self.agent = api.nixl_agent(name, config)
        except Exception as exc:
            raise BackendUnavailableError(f"NIXL agent could not start ({module_name}): {exc}") from exc
        self._backend_params: dict[str, dict[str, str]] = {}
        self._options: dict[str, list[str]] = {}  # each plugin's parameters, once loaded
        self._lock = threading.Lock()

    @classmethod
    def shared(cls) -> NixlRuntime:
        """The process's runtime, created on first use."""
        with cls._shared_lock:
            if cls._shared is None:
                module_name = os.environ.get(NIXL_MODULE_ENV, "")
                if module_name:
                    reason = NIXL_MODULE_ENV
                else:
                    module_name, reason = default_module()
                try:
                    api = importlib.import_module(module_name)
                except ImportError as exc:
                    raise BackendUnavailableError(
                        f"NIXL cannot be imported as {module_name!r}: {exc} "
                        "(install it with `pip install nixl`, or set "
                        f"{NIXL_MODULE_ENV} to e.g. nixl_cu12._api)"
                    ) from exc
                if not os.environ.get("NIXL_LOG_LEVEL"):
                    # NIXL logs every agent and backend creation at INFO to stdout, which
                    # is the server's console; keep its warnings and errors only.
                    logging.getLogger("nixl").setLevel(logging.WARNING)
                cls._shared = cls(api, module_name)
                log.info("NIXL module %s (%s)", module_name, reason)
            return cls._shared

    @property
    def agent_name(self) -> str:
        return str(self.agent.name)

    def plugins(self) -> list[str]:
        return list(self.agent.get_plugin_list())

    def ensure_backend(self, backend: str, init_params: dict[str, str]) -> None:
        """Create ``backend`` once per process, after checking it can run here."""
        check_before_l1(backend, init_params)
        with self._lock:
            # A misspelt parameter is named as such, whether or not the backend is up.
            options = self._plugin_options(backend)
            unknown = sorted(set(init_params) - set(options))
            if options and unknown:
                # A FieldError, so that start-up names the adapter and the key's path.
                raise FieldError(
                    f"backend_params.{unknown[0]}",
                    f"backend_params {', '.join(unknown)} not understood by NIXL's {backend} "
                    f"plugin; it accepts: {', '.join(sorted(options))}",
                )
            existing = self._backend_params.get(backend)
            if existing is not None:
                if existing != init_params:
                    # Named, not quoted: the values may be credentials (OBJ's secret_key).
                    differing = sorted(
                        key
                        for key in set(existing) | set(init_params)
                        if existing.get(key) != init_params.get(key)
                    )
                    verb = "differs" if len(differing) == 1 else "differ"
                    # A FieldError, so that start-up names the adapter refused (the later one).
                    raise FieldError(
                        f"backend_params.{differing[0]}",
                        f"NIXL backend {backend} is already initialised in this process with other "
                        f"parameters ({', '.join(differing)} {verb}); every adapter using {backend} "
                        "must pass the same NIXL parameters",
                    )
                return
            try:
                self.agent.create_backend(backend, dict(init_params))
            except Exception as exc:
                raise BackendUnavailableError(f"NIXL could not create the {backend} backend: {exc}") from exc
            self._backend_params[backend] = dict(init_params)
            log.info("NIXL backend %s created (%s)", backend, self.module_name)

    def _plugin_options(self, backend: str) -> list[str]:
        """The parameters ``backend``'s plugin accepts (call with the lock held)."""
        known = self._options.get(backend)
        if known is not None:
            return known
        available = self.plugins()
        if backend not in available:
            raise BackendUnavailableError(describe_missing_plugin(backend, available, self.module_name))
        try:
            # Loading the plugin's parameters dlopens it: a plugin whose own libraries
            # are missing fails here, quickly, instead of in create_backend.
            options, _mem_types = self.agent.agent.getPluginParams(backend)
        except Exception as exc:
            raise BackendUnavailableError(
                f"NIXL backend {backend} is not available: {self.module_name}'s {backend} "
                f"plugin cannot load its libraries ({exc}); for OBJ try "
                f"{NIXL_MODULE_ENV}=nixl_cu12._api"
            ) from exc
        self._options[backend] = known = list(options)
        return known

    def _register(self, backend: str, descs: Any) -> Registration:
        try:
            self.agent.register_memory(descs, backends=[backend])
        except Exception as exc:
            raise NixlTransferError(f"NIXL could not register memory with {backend}: {exc}") from exc
        return Registration(self, descs, backend)

    def register_dram(self, backend: str, regions: Sequence[tuple[int, int]]) -> Registration:
        """Register host memory regions given as (address, length)."""
        rows = descriptors([(address, length, 0) for address, length in regions])
        return self._register(backend, self.agent.get_reg_descs(rows, "DRAM"))

    def register_files(self, backend: str, fds: Sequence[int]) -> Registration:
        """Register open files; a zero length registers the whole file, however it grows."""
        rows = descriptors([(0, 0, fd) for fd in fds])
        return self._register(backend, self.agent.get_reg_descs(rows, "FILE"))

    def register_objects(self, backend: str, objects: Sequence[tuple[int, str]]) -> Registration:
        """Register object-store keys; NIXL addresses each by the device id paired with it."""
        rows = [(0, 0, device_id, name) for device_id, name in objects]
        return self._register(backend, self.agent.get_reg_descs(rows, "OBJ"))

    def transfer_many(
        self,
        backend: str,
        operation: str,
        requests: Sequence[tuple[Descriptors, Descriptors]],
        storage_mem: str,
        *,
        background: bool = False,
        overdue: OverdueTransfers | None = None,
    ) -> None:
        """Run READs (storage -> DRAM) or WRITEs (DRAM -> storage) to completion: every
        (DRAM, storage) pair is posted as a NIXL request of its own, then all are waited
        for; a failure of any fails the call, once none is still running.  ``background``:
        write-back, which waits with fewer polls; ``overdue``: where a wait past its
        deadline is counted (the adapter's stats)."""
        agent = self.agent
        posted: list[Any] = []
        running: list[Any] = []
        failure: NixlTransferError | None = None
        try:
            for dram, storage in requests:
                try:
                    local = agent.get_xfer_descs(dram, "DRAM")
                    remote = agent.get_xfer_descs(storage, storage_mem)
                    handle = agent.initialize_xfer(operation, local, remote, agent.name, backends=[backend])
                except Exception as exc:
                    failure = NixlTransferError(f"NIXL {operation} on {backend} could not be prepared: {exc}")
                    break
                posted.append(handle)
                try:
                    state = agent.transfer(handle)
                except Exception as exc:
                    failure = NixlTransferError(f"NIXL {operation} on {backend} failed: {exc}")
                    break
                if state == "PROC":
                    running.append(handle)
                elif state != "DONE":
                    failure = NixlTransferError(f"NIXL {operation} on {backend} ended in state {state}")
                    break
            # Requests already posted are waited for even after a failure: their buffers
            # must not be given back while NIXL may still move them.
            try:
                self._wait(running, operation, backend, background, overdue)
            except NixlTransferError as exc:
                failure = failure or exc
            except Exception as exc:
                failure = failure or NixlTransferError(f"NIXL {operation} on {backend} failed: {exc}")
        finally:
            for handle in posted:
                self._release(handle, operation, backend)
        if failure is not None:
            raise failure

    @staticmethod
    def _release(handle: Any, operation: str, backend: str) -> None:
        try:
            handle.release()
        except Exception as exc:
            log.warning("NIXL could not release a %s handle on %s: %s", operation, backend, exc)

    def _wait(
        self,
        handles: Sequence[Any],
        operation: str,
        backend: str,
        background: bool = False,
        overdue: OverdueTransfers | None = None,
    ) -> None:
        """Poll ``handles`` (posted, still running when posted) until every one ended.  A
        round polls them in posting order and stops at the first still running (requests
        posted together finish about in order): one poll per round and one per request,
        not one per request per round.  A request past ``TRANSFER_TIMEOUT_S`` is logged
        (again after each further period), counted in ``overdue`` and still waited for
        (see there)."""
        missed: list[bool] = []  # one entry once the first deadline passed

        def past_deadline() -> None:
            if not missed:  # one stuck transfer, however many periods it stays stuck
                missed.append(True)
                if overdue is not None:
                    overdue.missed()

        try:
            self._poll_until_ended(handles, operation, backend, background, past_deadline)
        finally:
            if missed and overdue is not None:
                overdue.ended()

    def _poll_until_ended(
        self,
        handles: Sequence[Any],
        operation: str,
        backend: str,
        background: bool,
        past_deadline: Callable[[], None],
    ) -> None:
        started = time.monotonic()
        deadline = started + TRANSFER_TIMEOUT_S
        spins, sleep, longest = _SPIN_POLLS, 0.00001, _MAX_SLEEP_S
        if background:
            spins, sleep, longest = 0, _BACKGROUND_FIRST_SLEEP_S, _BACKGROUND_MAX_SLEEP_S
        pending = list(handles)
        failed: str | None = None
        rounds = 0
        while pending:
            rounds += 1
            if rounds > spins:
                if time.monotonic() > deadline:
                    past_deadline()
                    log.warning(
                        "NIXL %s on %s still running after %.0f s (storage stalled?); waiting for "
                        "it to end, as its memory cannot be given back while it may still move",
                        operation,
                        backend,
                        time.monotonic() - started,
                    )
                    deadline = time.monotonic() + TRANSFER_TIMEOUT_S
                time.sleep(sleep)
                sleep = min(sleep * 2, longest)
            while pending:
                try:
                    state = self._transfer_state(pending[0])
                except Exception as exc:
                    # NIXL raises for a request that failed; the requests posted with it
                    # may still be running and are waited for all the same.
                    state = f"ERR ({exc})"
                if state == "PROC":
                    break
                pending.pop(0)
                if state != "DONE" and failed is None:
                    failed = state
        if failed is not None:
            raise NixlTransferError(f"NIXL {operation} on {backend} ended in state {failed}")

    def _transfer_state(self, handle: Any) -> str:
        """NIXL's state of a posted request: "PROC" while it runs, "DONE" once it ended well."""
        return str(self.agent.check_xfer_state(handle))
