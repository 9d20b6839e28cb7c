"""Start-up checks that look at the machine, run before the L1 arena is pre-faulted.

Pre-faulting a large L1 takes seconds; a port in use, a mistyped adapter path or an L1
larger than the machine can hold should cost none of them.  Each check raises
:class:`~lmcache_tiers.errors.ConfigError` with one line naming the flag (or the config
path) and what to do; ``serve`` prints it and exits 2.  The later, real bind or mapping can
still fail (something took the port in between): :func:`listen_error` words that failure
the same way.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import socket
import stat
from typing import TYPE_CHECKING

from lmcache_tiers.errors import ConfigError, SettingRefused
from lmcache_tiers.l1.arena import segment_bytes
from lmcache_tiers.l1.segment import check_directory, file_bytes
from lmcache_tiers.l2.preflight import preflight_adapters
from lmcache_tiers.router import BIND_DIRECTORY_PREFIX, STAGED_SOCKET_NAME, socket_file_listened

if TYPE_CHECKING:
    from lmcache_tiers.config import ServerConfig
    from lmcache_tiers.registry import ComponentRegistry

__all__ = [
    "RECOMMENDED_OPEN_FILES",
    "SERVE_OPEN_FILES",
    "check_l1_room",
    "check_listeners",
    "check_open_files",
    "listen_error",
    "listener_setting",
    "mem_available",
    "open_files_limit",
    "open_files_refusal",
    "preflight",
    "raise_open_files_limit",
]

logger = logging.getLogger(__name__)

_GIB = float(1 << 30)
_MIB = float(1 << 20)
#: the least serve starts and answers a client with (measured: 19 held by a native front
#: end without L2 and without the HTTP endpoint once it serves, 26 with the default fs
#: L2; its start makes sure of room for libzmq's threads besides, which 21 leaves); below
#: it no configuration can work.  A higher floor would refuse small configurations that
#: serve fine: above it a config that needs more meets EMFILE while starting, which is
#: one line too (``open_files_refusal(..., while_starting=True)``)
SERVE_OPEN_FILES = 21
#: what a server with many clients and L2 files in flight needs: each client connection,
#: L2 file being read or written and NIXL or NVMe transfer holds one
RECOMMENDED_OPEN_FILES = 1024
#: beyond the segment: the process's own memory
_L1_HEADROOM_BYTES = 64 << 20


def mem_available() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (None where there is no such file)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _shm_free(directory: str) -> int | None:
    try:
        info = os.statvfs(directory)
    except OSError:
        return None
    return info.f_bavail * info.f_frsize


def _size_text(size: float) -> str:
    """GiB with two decimals, or MiB below one GiB (a 4 MiB tmpfs read "0.00 GiB")."""
    if size >= _GIB:
        return f"{size / _GIB:.2f} GiB"
    return f"{size / _MIB:.1f} MiB"


def open_files_limit() -> int | None:
    """The soft RLIMIT_NOFILE (``ulimit -n``), None when unlimited."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def open_files_refusal(limit: int | None, *, while_starting: bool = False) -> ConfigError:
    """The one line for a limit below what serve needs to start, or (``while_starting``)
    for a start that ran out of descriptors (EMFILE) under ``limit`` all the same."""
    shown = "unlimited" if limit is None else str(limit)
    if while_starting:
        need = "serve ran out of open files while starting (each L2 adapter and front end takes some)"
    else:
        need = (
            f"serve needs at least {SERVE_OPEN_FILES} open files to start and about "
            f"{RECOMMENDED_OPEN_FILES} to serve many clients"
        )
    # serve has already lifted its soft limit to the hard one: only the hard limit can help,
    # raised past what it is (a start that ran out under 20000 is not helped by 1024)
    suggested = RECOMMENDED_OPEN_FILES if limit is None or limit < RECOMMENDED_OPEN_FILES else 2 * limit
    return ConfigError(
        f"ulimit -n {shown}: {need}; raise the hard limit "
        f"(ulimit -Hn {suggested}, or LimitNOFILE= in a systemd unit)"
    )


def raise_open_files_limit() -> None:
    """Raise the soft RLIMIT_NOFILE to the hard one, as systemd advises a program that
    needs many descriptors and does not ``select()`` on them to do (serve's wait on its
    wake pipe uses ``poll``, as a pipe may be above FD_SETSIZE): the soft default (1024
    on most distributions) is what a busy server's clients and L2 files run into first."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or (hard != resource.RLIM_INFINITY and soft >= hard):
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:  # a hard limit the kernel caps lower (nr_open)
        logger.info("the open files limit stays at %d: raising it to %s failed (%s)", soft, hard, exc)
        return
    shown = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    logger.info("raised the open files limit (ulimit -n) from %d to %s, the hard limit", soft, shown)


def check_open_files(config: ServerConfig) -> None:
    """Raise the soft descriptor limit to the hard one; then refuse a limit serve cannot
    start under (the front end's socket failed with a bare "Too many open files"), and warn
    once under one its clients would hit: at the limit libzmq's accept fails with EMFILE and
    new clients wait, retried."""
    raise_open_files_limit()
    limit = open_files_limit()
    if limit is None:
        return
    if limit < SERVE_OPEN_FILES:
        raise open_files_refusal(limit)
    if limit < RECOMMENDED_OPEN_FILES:
        logger.warning(
            "the open files limit (ulimit -n) is %d: a client connection, an L2 file or transfer "
            "each take one, and at the limit new clients cannot connect; raise the hard limit "
            "(ulimit -Hn, or LimitNOFILE= in a systemd unit) to %d or more",
            limit,
            RECOMMENDED_OPEN_FILES,
        )


def check_l1_room(config: ServerConfig) -> None:
    """A memory L1 must fit both in its tmpfs directory's free space (/dev/shm unless
    l1_shm_dir) and in the memory available: the segment is a tmpfs file whose every page
    is pre-faulted at start-up."""
    if config.gds_l1_path is not None:
        return  # an NVMe L1 takes disk space, preallocated without touching memory
    directory = config.l1_shm_dir
    check_directory(directory)
    segment = file_bytes(segment_bytes(config.l1_size_bytes, config.l1_align_bytes), directory)
    need = segment + _L1_HEADROOM_BYTES
    # The setting is named by its config key here; serve names --l1-size-gb (or its
    # environment variable) instead when one of those set the size.
    size = f"{config.l1_size_gb:g}"
    shm = _shm_free(directory)
    if shm is not None and segment > shm:
        raise SettingRefused(
            "l1_size_gb",
            size,
            f"{directory} has {_size_text(shm)} free; lower it or enlarge {directory} "
            "(mount -o remount,size=...)",
        )
    available = mem_available()
    if available is not None and need > available:
        raise SettingRefused(
            "l1_size_gb",
            size,
            f"this machine has {_size_text(available)} of memory available (MemAvailable); "
            "lower it or free memory",
        )


def listener_setting(config: ServerConfig, index: int | None, field: str = "port") -> str:
    """The config key (or config path) of a listener's ``field`` ("port" or "host"): front
    end ``index``, or the HTTP endpoint (None).  ``serve`` names the flag instead when one
    set the value (``SettingRefused``)."""
    if index is None:
        return f"metrics_{field}"
    if getattr(config.frontends[index].config, field) is None:
        return field  # the server's own host and port, which the front end takes
    return f"$.frontends[{index}].{field}"


def listen_error(config: ServerConfig, index: int | None, host: str, port: int, exc: OSError) -> ConfigError:
    """One line for listener ``index`` (None: the HTTP endpoint) that cannot bind
    ``host``:``port``, naming the setting to change."""
    number = exc.errno
    if number == errno.EMFILE:  # the limit is what to change, not the setting of this listener
        return open_files_refusal(open_files_limit(), while_starting=True)
    if host.startswith("ipc://"):
        reason = os.strerror(number) if number else str(exc)
        return SettingRefused(listener_setting(config, index, "host"), host, f"cannot listen there: {reason}")
    where = f"{host}:{port}"
    if number == errno.EADDRNOTAVAIL:
        return SettingRefused(
            listener_setting(config, index, "host"),
            host,
            "not an address of this machine; give one of its addresses",
        )
    if number == errno.EADDRINUSE:
        reason = f"{where} is already in use (another server?); stop it or give another port"
    elif number == errno.EACCES:
        reason = f"port {port} is privileged on this machine; give a port above 1023"
    else:
        reason = f"cannot listen on {where}: {exc.strerror or exc}"
    return SettingRefused(listener_setting(config, index), port, reason)


def _probe_bind(host: str, port: int) -> None:
    """Bind (and close at once) what the listener will bind, with the options servers
    use (SO_REUSEADDR: a port in TIME_WAIT is free, one being listened on is not)."""
    bind_host = "0.0.0.0" if host in ("", "*") else host.strip("[]")
    if bind_host == "localhost":
        bind_host = "127.0.0.1"
    try:
        infos = socket.getaddrinfo(bind_host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise OSError(errno.EADDRNOTAVAIL, str(exc)) from None
    family, kind, proto, _name, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(address)


def _check_ipc_path(config: ServerConfig, index: int | None, host: str) -> None:
    """ZeroMQ creates the socket file, not its directory (``@name``: an abstract socket)."""
    path = host[len("ipc://") :]
    setting = listener_setting(config, index, "host")
    _check_ipc_path_length(setting, host, path)
    if path.startswith("@"):
        return
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        what = "is a file, not a directory" if os.path.exists(parent) else "does not exist"
        raise SettingRefused(setting, host, f"{parent} {what}; give a socket path in an existing directory")
    if os.path.isdir(path):
        raise SettingRefused(setting, host, f"{path} is a directory; give the path of a socket file")
    _check_ipc_path_free(setting, host, path)


#: bytes of a path a Unix socket address holds (``sun_path`` is 108 with its NUL)
UNIX_SOCKET_PATH_MAX = 107
#: where ``RouterLoop._bind_private_ipc`` binds a socket before linking it at its path: a
#: ``tempfile.mkdtemp`` directory (the prefix and 8 characters) next to it, and a file ``s``
IPC_STAGING_NAME = f"{BIND_DIRECTORY_PREFIX}XXXXXXXX/{STAGED_SOCKET_NAME}"


def _check_ipc_path_length(setting: str, host: str, path: str) -> None:
    """Clients connect to the path exactly as given, and the kernel takes at most
    :data:`UNIX_SOCKET_PATH_MAX` bytes of it (an abstract ``@name`` too).  The server
    itself binds in a short private directory and links the socket at the path, so a
    longer one would bind: it would serve an endpoint no client can ever reach."""
    length = len(os.fsencode(path))
    if length > UNIX_SOCKET_PATH_MAX:
        raise SettingRefused(
            setting,
            host,
            f"the socket path is {length} bytes, and a Unix socket address holds at most "
            f"{UNIX_SOCKET_PATH_MAX}; give a shorter path",
        )
    if path.startswith("@"):
        return
    staged = os.path.join(os.path.dirname(path) or ".", IPC_STAGING_NAME)
    if len(os.fsencode(staged)) > UNIX_SOCKET_PATH_MAX:
        raise SettingRefused(
            setting,
            host,
            f"the server binds it first as {staged} ({len(os.fsencode(staged))} bytes), and a Unix "
            f"socket address holds at most {UNIX_SOCKET_PATH_MAX}; give a path in a shorter directory",
        )


def _check_ipc_path_free(setting: str, host: str, path: str) -> None:
    """The server links its socket at the path and replaces only a socket that nothing
    listens on any more (left by a server that was killed): a file there, or a live
    server's socket (whose clients could no longer reach it), is refused here before the
    L1 arena is pre-faulted, with what to do.  The probe does not block on a live
    server that accepts nobody (see :func:`~lmcache_tiers.router.socket_file_listened`)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise SettingRefused(
            setting, host, f"{path} exists and is not a socket; give a path that does not exist"
        )
    try:
        listened = socket_file_listened(path)
    except FileNotFoundError:
        return  # gone meanwhile
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        raise SettingRefused(setting, host, f"cannot check whether {path} is in use: {reason}") from None
    if not listened:
        return  # a stale socket file: the bind replaces it
    raise SettingRefused(
        setting, host, f"{path} is already in use (another server?); stop it or give another path"
    )


def check_listeners(config: ServerConfig) -> None:
    """Every TCP listener (front ends, the HTTP endpoint) can bind its address now."""
    listeners: list[tuple[int | None, str, int]] = []
    for position, spec in enumerate(config.frontends):
        host, port = spec.config.address(config)
        listeners.append((position, host, port))
    if config.metrics_port:
        listeners.append((None, config.metrics_host, config.metrics_port))
    for index, host, port in listeners:
        if host.startswith("ipc://"):
            _check_ipc_path(config, index, host)
            continue
        # Port 0 is probed too: any free port binds, but only on an address of this
        # machine, and a name that resolves to none failed the real bind after L1 was
        # pre-faulted, naming the port.
        try:
            _probe_bind(host, port)
        except OSError as exc:
            raise listen_error(config, index, host, port, exc) from None


def preflight(config: ServerConfig, registry: ComponentRegistry) -> None:
    """Every check of the machine that is cheap, in the order a user fixes things."""
    check_open_files(config)
    preflight_adapters(registry, config)
    check_listeners(config)
    check_l1_room(config)
