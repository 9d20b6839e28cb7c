"""Pre-flight checks of L2 adapter configs: cheap, run for every adapter before L1 exists.

A backend class (or factory function) may carry ``preflight(config) -> None``, a
classmethod or staticmethod found by name (so may a serde's, for its config).  It looks
at the environment the config names -- paths, devices, keys -- without building anything,
and raises :class:`~lmcache_tiers.config.FieldError` naming the field at fault.  The
server runs it for every configured adapter before the L1 arena is pre-faulted, so a typo
in a path costs no start-up time, and the error names ``$.l2_adapters[i].<field>``.

The two helpers here are what file, slot and device stores need: a directory the store
may create, and a file (or device node) it may create or open.  They create nothing,
except one probe directory, removed at once, where only trying tells whether this user
may create entries (permissions, read-only or virtual filesystems).
:func:`direct_io_refusal` tells a store, once its directory exists, whether the
filesystem there takes ``O_DIRECT`` transfers.

Stores that lock what they use refuse, here already, what the lock would refuse at open:
:func:`check_directory_free` a directory another live server (or an adapter of this one)
holds -- the probe of :class:`~lmcache_tiers.l2.files.DirectoryLock`, which tries its
locks and lets go at once -- :func:`check_process_claim_free` a store that lives in the
process (fsspec's ``memory://``) and so is claimed per process, and
:func:`check_claimed_once` anything else (a device) that an earlier adapter of the same
config names.  The open stays the authority: a holder may appear between the two.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import stat
import threading
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from lmcache_tiers.config import FieldError, decode_adapter_at
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.l2.files.dirlock import (
    DirectoryInUseError,
    claim_in_preflight,
    preflight_claims,
    probe_directory,
    probe_process_claim,
)
from lmcache_tiers.registry import Kind

if TYPE_CHECKING:
    from lmcache_tiers.config import AdapterSpec, ServerConfig
    from lmcache_tiers.registry import ComponentRegistry

__all__ = [
    "check_claimed_once",
    "check_directory",
    "check_directory_free",
    "check_file",
    "check_process_claim_free",
    "direct_io_refusal",
    "preflight_adapters",
]

#: filesystems that hold no files of ours, whatever the permissions say
_VIRTUAL_ROOTS = ("/proc", "/sys")


def _existing_ancestor(path: str) -> tuple[str, os.stat_result]:
    """The nearest ancestor of ``path`` (itself included) that exists, and its stat."""
    probe = path
    while True:
        try:
            return probe, os.stat(probe)
        except FileNotFoundError:
            parent = os.path.dirname(probe)
            if parent == probe:
                raise
            probe = parent
        except NotADirectoryError:
            # some component on the way is a file: find it by walking up further
            probe = os.path.dirname(probe)


def _under_virtual_fs(path: str) -> str | None:
    real = os.path.realpath(path)
    for root in _VIRTUAL_ROOTS:
        if real == root or real.startswith(root + "/"):
            return root
    return None


def _probe_create(directory: str, field: str, target: str, problem: str = "cannot be created") -> None:
    """Create and remove one entry in ``directory``: the only sure test of whether this
    user can create ``target`` there (``problem``: what a refusal means for ``target``)."""
    probe = os.path.join(directory, f".lmcache-tiers-preflight-{os.getpid()}")
    try:
        os.mkdir(probe, 0o700)
    except FileExistsError:
        return  # a probe left by a killed process of the same pid: creating works
    except OSError as exc:
        reasons = {
            errno.EACCES: f"this user may not create entries in {directory}",
            errno.EPERM: f"this user may not create entries in {directory}",
            errno.EROFS: f"{directory} is on a read-only filesystem",
            errno.ENOSPC: f"the filesystem of {directory} is full",
            errno.EDQUOT: f"this user's disk quota on {directory} is used up",
        }
        reason = reasons.get(exc.errno or 0, f"creating an entry in {directory} fails ({exc.strerror})")
        raise FieldError(field, f"{target} {problem}: {reason}; give a writable path") from None
    with contextlib.suppress(OSError):
        os.rmdir(probe)


def _refuse_virtual(path: str, field: str) -> None:
    virtual = _under_virtual_fs(path)
    if virtual is not None:
        raise FieldError(
            field,
            f"{path} is under {virtual}, a virtual filesystem that cannot hold a store; give a disk path",
        )


def _check_creatable(path: str, field: str) -> None:
    """``path`` does not exist: its nearest existing ancestor must be a writable directory."""
    _refuse_virtual(path, field)
    ancestor, info = _existing_ancestor(path)
    if not stat.S_ISDIR(info.st_mode):
        raise FieldError(
            field, f"{path} cannot be created: {ancestor} is a file, not a directory; give another path"
        )
    _probe_create(ancestor, field, path)


def _check_file_creatable(path: str, field: str) -> None:
    """A file is created in a directory that exists (its directories are not made)."""
    _refuse_virtual(path, field)
    parent = os.path.dirname(path)
    ancestor, info = _existing_ancestor(parent)
    if not stat.S_ISDIR(info.st_mode):
        raise FieldError(field, f"{path} cannot be created: {ancestor} is a file, not a directory")
    if ancestor != parent:
        raise FieldError(field, f"{path} cannot be created: directory {parent} does not exist")
    _probe_create(parent, field, path)


def _absolute_stat(path: str, field: str, what: str) -> tuple[str, os.stat_result | None]:
    """The absolute path and its stat, None when nothing is there yet."""
    if not path:
        raise FieldError(field, f"the {what} must not be empty")
    path = os.path.abspath(path)
    try:
        return path, os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return path, None
    except OSError as exc:
        raise FieldError(field, f"cannot use {path}: {exc.strerror}") from None


def check_directory(path: str, field: str) -> None:
    """Refuse a directory path a store cannot use: a file where the directory should be, a
    path under a file, under /proc or /sys, or where this user cannot create it.  A
    directory that exists must be writable and searchable."""
    path, info = _absolute_stat(path, field, "directory")
    if info is None:
        _check_creatable(path, field)
        return
    if not stat.S_ISDIR(info.st_mode):
        raise FieldError(field, f"{path} is a file, not a directory; give a directory (or remove the file)")
    _refuse_virtual(path, field)
    _probe_create(path, field, path, "exists but cannot be written to")


def check_file(path: str, field: str, *, devices: str = "", create: bool = True) -> None:
    """Refuse a file path a store cannot open: a directory, a path under a file, a file
    that does not exist and cannot be created (``create``).  ``devices`` names the device
    nodes also accepted ("block", "char"); an existing one is left to the store to open."""
    path, info = _absolute_stat(path, field, "path")
    if info is None:
        if not create:
            raise FieldError(field, f"{path} does not exist")
        _check_file_creatable(path, field)
        return
    mode = info.st_mode
    if stat.S_ISREG(mode):
        if not os.access(path, os.R_OK | os.W_OK):
            raise FieldError(field, f"this user may not read and write {path}")
        return
    if (stat.S_ISBLK(mode) and "block" in devices) or (stat.S_ISCHR(mode) and "char" in devices):
        return
    kind = "a directory" if stat.S_ISDIR(mode) else "neither a regular file nor an accepted device"
    accepted = {"block": "block device", "char": "character device"}
    wanted = " or ".join(["a regular file"] + [f"a {accepted[kind]}" for kind in accepted if kind in devices])
    raise FieldError(field, f"{path} is {kind}; give {wanted}")


def check_directory_free(path: str, field: str, *, what: str) -> None:
    """Refuse a directory ``DirectoryLock(path, what=what)`` would refuse now -- another
    live server holds it (named by pid when known), an adapter of this process does, or
    an earlier adapter of the config being checked names it -- with the lock's own words.
    Best effort and side-effect free: the locks are tried and let go at once, nothing is
    created (a missing directory or lock file is free)."""
    with _refused_at(field):
        probe_directory(path, what=what)


def check_process_claim_free(identity: str, field: str, *, what: str) -> None:
    """Refuse ``identity`` when ``ProcessClaim(identity, what=what)`` would refuse it now
    (an adapter of this process holds it) or an earlier adapter of the config being
    checked names it, with the claim's own words."""
    with _refused_at(field):
        probe_process_claim(identity, what=what)


def check_claimed_once(identity: str, field: str, message: str) -> None:
    """Refuse ``identity`` (a device, a file: whatever one adapter may hold alone) with
    ``message`` when an earlier adapter of the config being checked claimed it."""
    with _refused_at(field):
        claim_in_preflight(identity, message)


@contextlib.contextmanager
def _refused_at(field: str) -> Iterator[None]:
    """A refusal of a lock's probe, as the pre-flight's error naming ``field``."""
    try:
        yield
    except DirectoryInUseError as exc:
        raise FieldError(field, str(exc)) from None


#: the transfer unit of the direct I/O probe (the page size every filesystem aligns to)
_DIRECT_PROBE_BYTES = 4096


def direct_io_refusal(directory: str) -> str | None:
    """Why the filesystem of ``directory`` (which exists) refuses ``O_DIRECT``, or None
    when it takes it.

    One aligned block is written and read back through a probe file: some filesystems
    (ramfs, tmpfs before Linux 6.6) refuse the flag at open, others (FUSE, network
    filesystems) only on the first transfer, which must show here, not as EINVAL on every
    store.  The probe has a
    temporary-file name (``.tmp-*.part``), so one a crash leaves behind is swept like the
    others.  Errors other than a refusal of direct I/O (permissions, a full disk) raise.
    """
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return "this platform has no O_DIRECT"
    # one name per thread: two adapters may probe the same directory at once
    probe = os.path.join(directory, f".tmp-directio-{os.getpid()}-{threading.get_native_id()}.part")
    block = mmap.mmap(-1, _DIRECT_PROBE_BYTES)  # page-aligned, as O_DIRECT wants
    try:
        try:
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | flag, 0o600)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return exc.strerror or "EINVAL"
            raise
        try:
            os.pwrite(fd, block, 0)
            os.preadv(fd, [block], 0)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return exc.strerror or "EINVAL"
            raise
        finally:
            os.close(fd)
    finally:
        block.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(probe)
    return None


def _run_preflight(registry: ComponentRegistry, kind: Kind, type_name: str, config: Any, where: str) -> None:
    """The ``preflight(config)`` of component ``type_name`` of ``kind``, if it has one;
    what it refuses becomes a ConfigError naming ``where`` (and the field, if named)."""
    factory: Any = registry.get(kind, type_name).load()
    preflight = getattr(factory, "preflight", None)
    if not callable(preflight):
        return
    try:
        preflight(config)
    except FieldError as exc:
        raise ConfigError(f"{type_name}: {exc} - at `{where}.{exc.field}`") from None
    except ConfigError as exc:
        prefix = "" if str(exc).startswith(f"{type_name}: ") else f"{type_name}: "
        raise ConfigError(f"{prefix}{exc} - at `{where}`") from None


def _preflight_one(registry: ComponentRegistry, spec: AdapterSpec, where: str) -> None:
    _run_preflight(registry, Kind.L2_ADAPTER, spec.type, spec.config, where)
    # A serde's too (its keys, say): read after L1 is pre-faulted, one missing cost that time.
    for position, serde in enumerate(spec.serde):
        _run_preflight(registry, Kind.SERDE, serde.type, serde.config, f"{where}.serde[{position}]")
    # A wrapper's backend (fault_inject ...) is built from its `inner` spec: check it too.
    inner = getattr(spec.config, "inner", None)
    if isinstance(inner, Mapping):
        # decoded with the wrapper's config already: a bad inner spec never gets here
        _preflight_one(registry, decode_adapter_at(registry, inner, f"{where}.inner"), f"{where}.inner")


def preflight_adapters(registry: ComponentRegistry, config: ServerConfig) -> None:
    """Run every configured adapter's ``preflight``; raises ConfigError naming the field.
    What one adapter claims (a directory, a device) is refused to the adapters after it."""
    with preflight_claims():
        for index, spec in enumerate(config.l2_adapters):
            _preflight_one(registry, spec, f"$.l2_adapters[{index}]")
