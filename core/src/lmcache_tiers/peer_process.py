"""The process at the other end of a connection, and whether it has exited.

A front end fences the extents of a shared-memory store that expired before its client
said its copy was over (``L1Manager.fence_writers``).  A client whose process exited
copies nothing any more, so its fences can be lifted; for that the server must know the
client's process, which a protocol may not carry.  The kernel knows it:

* ``ipc://`` (a Unix socket): ``SO_PEERCRED`` gives the pid of the process that
  connected, translated into the server's pid namespace; 0 when it has no pid there (a
  client in a pid namespace the server cannot see): :attr:`PeerSocket.foreign`, whose
  process nothing here can name -- a pid the client reports is of its own namespace and
  may name an unrelated process here, so a front end must not watch one for it;
* ``tcp://`` over loopback, or to the server's own address from this host (far end and
  near end the same address): the client's socket is the one whose local address is the
  connection's far end, asked of the kernel by address (``sock_diag``), else found in
  ``/proc/net/tcp{,6}`` (a walk of the whole table); the processes other than the server
  holding its inode in ``/proc/*/fd`` are its owners (a scan, about 1.8 ms per thousand
  descriptors open on the host, so once per connection).  Where the client said its pid
  (:attr:`PeerSocket.hint`: the native protocol's HELLO) the scan looks in that process's
  descriptors and its descendants' first (:func:`_hinted_holders`), and walks every
  process only if the socket is not there;
* anything else (a remote peer, a process not visible here, a /proc mounted for
  another pid namespace, a lookup that failed): unknown, and a front end keeps its fences as before.

The descriptor must be the one the message came in on, looked at as it is received
(ZeroMQ's ``zmq.SRCFD`` of a frame): libzmq closes it when the connection ends and the
number is soon another connection's.

The scan walks every process's descriptors, so a server must not run it where a slow
one holds other work up: :func:`peer_socket` is the cheap part (what the kernel says of
the descriptor at once, read while the descriptor is still the connection's), and
:func:`watch_peer_socket` the scan and watch, which may run later on another thread.

Left: an owner the scan cannot see (another user's process, when the server does not
run as root), holding the same loopback socket as one it sees, is not waited for.  Nor is
a process whose first thread has exited while others run on (``pthread_exit`` in
``main``): its ``/proc/<pid>/fd`` and maps read empty, so alone it is not found (its
fences stay), but beside another holder (a child it forked) only that one is waited for.
Reading each such process's threads would cost the full scan a listing per kernel thread.

A process found at a connection's far end is the writer of a shared-memory store only if
it maps the segment itself (:func:`maps_file`; :func:`watch_writer_socket` checks it as
soon as the pidfds are open): a local relay between the client and the server holds the
connection but copies nothing, and its exit says nothing of the client's.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import select
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass

from lmcache_tiers.peer_ancestors import AncestorSockets

__all__ = [
    "FullScan",
    "PeerProcess",
    "PeerSocket",
    "maps_file",
    "peer_pids",
    "peer_socket",
    "peer_socket_pids",
    "pidfd_exited",
    "process_exiting",
    "socket_gone",
    "socket_holders",
    "watch_peer",
    "watch_peer_socket",
    "watch_writer_socket",
]

#: struct ucred: pid, uid, gid
_UCRED = struct.Struct("3i")


@dataclass(frozen=True)
class PeerSocket:
    """What the kernel says of a connection's far end without a scan: the pid
    ``SO_PEERCRED`` named (``ipc://``), or the loopback TCP addresses (far end, near end)
    whose owner :func:`peer_socket_pids` scans /proc for.  It names no descriptor, so it
    stays true of its connection after the descriptor's number goes to another."""

    pid: int = 0
    far: tuple[object, ...] = ()
    near: tuple[object, ...] = ()
    #: SO_PEERCRED named no pid: the client is in a pid namespace this server cannot see
    foreign: bool = False
    #: the pid the client says it has (0: none said), where a loopback TCP scan looks
    #: first; never trusted: only a process found holding the socket is taken
    hint: int = 0

    @property
    def remote(self) -> bool:
        """A TCP peer not on this host's network stack: another host's process (or one
        behind another network namespace), which nothing here can name.  A peer on
        loopback, or at the server's own address (a client here connecting to the host's
        address rather than 127.0.0.1), is not."""
        if not self.far:
            return False
        try:
            return not _same_stack(_ip(self.far), _ip(self.near))
        except ValueError:
            return True


def _ip(end: tuple[object, ...]) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """A socket address's IP, a v4-mapped IPv6 one as its IPv4 address."""
    address = ipaddress.ip_address(str(end[0]))
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _same_stack(
    far: ipaddress.IPv4Address | ipaddress.IPv6Address, near: ipaddress.IPv4Address | ipaddress.IPv6Address
) -> bool:
    """Whether a connection's far end is of this network namespace: on loopback, or at the
    server's own address (the kernel routes a connection to one's own address locally,
    from that address).  Either way the client's socket is in this namespace's
    ``/proc/net/tcp``, which a scan then looks for by both addresses, so a far end taken
    for local wrongly finds no socket, never another's."""
    return far.is_loopback or far == near


def peer_socket(fd: int) -> PeerSocket | None:
    """The far end of the connected socket ``fd``, read at once (no /proc scan); None
    when it cannot be told (see the module).  A Unix peer with no pid in this namespace
    is a :attr:`PeerSocket.foreign` one, not None: a front end must tell it apart from a
    connection it knows nothing of."""
    if fd < 0:
        return None
    try:
        copy = os.dup(fd)
    except OSError:
        return None
    try:
        sock = socket.socket(fileno=copy)
    except OSError:
        # Not a socket (the number went to another file once libzmq closed it): the
        # constructor leaves the copy open, and each such request would keep one.
        os.close(copy)
        return None
    with sock:
        try:
            if sock.family == socket.AF_UNIX:
                sock.getpeername()  # raises unless connected: an unconnected one names no peer
                pid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))[0]
                return PeerSocket(pid=pid) if pid > 0 else PeerSocket(foreign=True)
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                return PeerSocket(far=tuple(sock.getpeername()), near=tuple(sock.getsockname()))
        except OSError:
            return None
    return None


#: the full scan: the pids of every process but this one holding a socket's inode
FullScan = Callable[[int], tuple[int, ...]]


def peer_socket_pids(peer: PeerSocket, full_scan: FullScan | None = None) -> tuple[int, ...]:
    """The pids of the processes at ``peer`` (a /proc scan for a loopback TCP one; empty
    when they cannot be told).  ``full_scan``: what walks every process when the hint
    does not find the socket (:func:`socket_holders`; another to count its calls)."""
    if peer.pid > 0:
        return (peer.pid,)
    if peer.far and peer.near:
        try:
            return _loopback_owners(peer.far, peer.near, peer.hint, full_scan or socket_holders)
        except (OSError, ValueError):
            return ()
    return ()


def peer_pids(fd: int) -> tuple[int, ...]:
    """The pids of the processes at the other end of the connected socket ``fd`` (empty
    when that cannot be told: see the module)."""
    peer = peer_socket(fd)
    return () if peer is None else peer_socket_pids(peer)


def _loopback_owners(
    far: tuple[object, ...], near: tuple[object, ...], hint: int, full_scan: FullScan
) -> tuple[int, ...]:
    far_ip, near_ip = _ip(far), _ip(near)
    if not _same_stack(far_ip, near_ip):
        return ()  # another host's process: nothing here names it
    if not _proc_is_of_this_pid_namespace():
        return ()
    # The client's socket: its local address is our far end, its remote one our near end.
    wanted_local = (far_ip.packed, int(str(far[1])))
    wanted_remote = (near_ip.packed, int(str(near[1])))
    inode = _tcp_inode(wanted_local, wanted_remote)
    if not inode:
        return ()
    return _hinted_holders(inode, hint) or full_scan(inode)


def _proc_is_of_this_pid_namespace() -> bool:
    """Whether /proc's pids are this process's: one mounted for another pid namespace
    (``unshare --pid`` without a /proc of its own) names processes pidfd_open here finds
    as none (taken as exited) or as others."""
    try:
        return os.readlink("/proc/self") == str(os.getpid())
    except OSError:
        return False


def _tcp_inode(local: tuple[bytes, int], remote: tuple[bytes, int]) -> int:
    """The inode of the TCP socket with these addresses (0: none), asked of the kernel
    by address (:func:`_diag_inode`), else read from ``/proc/net/tcp{,6}``."""
    inode = _diag_inode(local, remote)
    return inode if inode is not None else _table_inode(local, remote)


#: netlink's NETLINK_SOCK_DIAG protocol and its SOCK_DIAG_BY_FAMILY request (linux/sock_diag.h)
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
#: nlmsghdr: length, type, flags, sequence, port id
_NLMSG = struct.Struct("=IHHII")
#: inet_diag_req_v2 before its socket id: family, protocol, extensions, pad, states
_DIAG_REQUEST = struct.Struct("=BBBBI")
#: inet_diag_sockid: source and destination ports (network order), addresses (16 bytes
#: each, an IPv4 one in the first 4), interface, cookie (INET_DIAG_NOCOOKIE: not checked)
_DIAG_SOCKID = struct.Struct("!HH16s16sI8s")
_NO_COOKIE = b"\xff" * 8
#: inet_diag_msg: family, state, timer, retransmits, the socket id, expires, receive and
#: send queues, uid, inode
_DIAG_MSG = struct.Struct("=BBBB48sIIIII")


def _diag_inode(local: tuple[bytes, int], remote: tuple[bytes, int]) -> int | None:
    """The inode of the TCP socket with these addresses, by the kernel's exact lookup
    (``sock_diag``: a hash lookup, tens of microseconds, where reading ``/proc/net/tcp``
    walks the whole table, about a millisecond); 0 when no such socket exists, None when
    the kernel did not answer (no netlink here, a filter refusing it, no such socket):
    then the tables are read.  An answer naming another socket than asked is taken as
    none (fail closed).

    ENOENT is not taken for "no such socket": it is also what the kernel answers when it
    has no sock_diag handler for TCP (``inet_diag``/``tcp_diag`` are modules, which a
    container may neither find loaded nor load), where every client would be taken as
    gone and its process never found; the table tells the two apart."""
    answer = _diag_answer(local, remote)
    return answer if answer is None else max(answer, 0)


def _diag_answer(local: tuple[bytes, int], remote: tuple[bytes, int]) -> int | None:
    """:func:`_diag_inode`'s answer, with -1 for one naming another socket than asked
    (where 0 is the asked socket, owned by no process)."""
    family = socket.AF_INET if len(local[0]) == 4 else socket.AF_INET6
    # sport and dport go in network order through "!": the struct packs them so
    wanted = _DIAG_SOCKID.pack(
        local[1], remote[1], local[0].ljust(16, b"\0"), remote[0].ljust(16, b"\0"), 0, _NO_COOKIE
    )
    request = _DIAG_REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + wanted
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as diag:
            diag.settimeout(1.0)
            diag.send(
                _NLMSG.pack(_NLMSG.size + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0) + request
            )
            answer = diag.recv(65536)
    except (OSError, AttributeError):  # AttributeError: a platform without AF_NETLINK
        return None
    try:
        kind = _NLMSG.unpack_from(answer)[1]
        if kind != _SOCK_DIAG_BY_FAMILY:  # NLMSG_ERROR included (see above)
            return None
        found_family, _, _, _, sockid, *_, inode = _DIAG_MSG.unpack_from(answer, _NLMSG.size)
    except struct.error:
        return None
    if found_family not in (socket.AF_INET, socket.AF_INET6):
        return -1
    # Compared by address and port only (the interface and cookie are the socket's own); a
    # dual-stack client's socket is an IPv6 one, answered with v4-mapped addresses.
    sport, dport, source, destination, _, _ = _DIAG_SOCKID.unpack(sockid)
    found = (_diag_address(found_family, source), sport), (_diag_address(found_family, destination), dport)
    return int(inode) if found == (local, remote) else -1


def _diag_address(family: int, raw: bytes) -> bytes:
    """An inet_diag_sockid address as packed bytes, a v4-mapped IPv6 one as its IPv4 one."""
    if family == socket.AF_INET:
        return raw[:4]
    return raw[12:] if raw[:12] == b"\x00" * 10 + b"\xff\xff" else raw


def _table_inode(local: tuple[bytes, int], remote: tuple[bytes, int]) -> int:
    """The inode of the TCP socket with these addresses in ``/proc/net/tcp{,6}`` (0:
    none).  An IPv4 address is looked for in ``tcp`` as is and in ``tcp6`` v4-mapped (a
    dual-stack client)."""
    return max(_table_entry(local, remote) or 0, 0)


def _table_entry(local: tuple[bytes, int], remote: tuple[bytes, int]) -> int | None:
    """:func:`_table_inode`, None when no line lists the socket (0: listed, owned by no
    process), and :data:`_NO_TABLE` when neither table could be read."""
    read = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as lines:
                next(lines, None)  # the header
                for line in lines:
                    fields = line.split()
                    if len(fields) < 10:
                        continue
                    if _address(fields[1]) == local and _address(fields[2]) == remote:
                        return int(fields[9])
            read = True
        except (OSError, ValueError):
            continue
    return None if read else _NO_TABLE


#: :func:`_table_entry`'s answer when no table could be read
_NO_TABLE = -2


def _address(text: str) -> tuple[bytes, int]:
    """``/proc/net/tcp``'s ``HEX:PORT`` (the address in 32-bit words of host order),
    with a v4-mapped IPv6 address as its IPv4 one."""
    host, port = text.split(":")
    raw = bytes.fromhex(host)
    packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    if len(packed) == 16 and packed[:12] == b"\x00" * 10 + b"\xff\xff":
        packed = packed[12:]
    return packed, int(port, 16)


def socket_holders(inode: int) -> tuple[int, ...]:
    """The full scan: every process but this one holding the socket ``inode``, by pid."""
    target = f"socket:[{inode}]"
    # The server's own descriptors are not read: one per connection (and per watch), they
    # are what grows with a client's connections, and a client in the server's own
    # process exits with it, so it is never waited for anyway.
    own = str(os.getpid())
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or entry.name == own:
            continue
        if _holds(int(entry.name), target):
            found.append(int(entry.name))
    return tuple(sorted(found))


def _holds(pid: int, target: str) -> bool:
    """Whether process ``pid`` has a descriptor reading as ``target`` (no: exited, or
    not ours to look at)."""
    try:
        for fd in os.scandir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(fd.path) == target:
                    return True
    except OSError:
        pass
    return False


def _hinted_holders(inode: int, hint: int) -> tuple[int, ...]:
    """The holders of the socket ``inode`` among the process ``hint`` and its
    descendants (``/proc/<pid>/task/*/children``, each thread's, recursively); empty when
    none holds it, or the tree cannot be read whole, and the caller then scans every
    process.  A few processes read instead of every one: the hint is the client's own word.

    Any process found holds the socket, whatever the hint named (the inode is the
    kernel's), so a wrong hint (a lying or stale pid, a pid of another namespace, a
    socket passed by SCM_RIGHTS to a process outside the tree) finds none and falls back
    to the full scan.  What it can miss is a holder outside the tree while one inside
    holds it too, where the full scan would have found both and waited for both:

    * the hint's ancestors are read too (once per hinted process, see
      :mod:`~lmcache_tiers.peer_ancestors`): one holding the socket means the hint is not
      the process that created it (a HELLO naming a forked child while its parent
      writes), and the full scan answers instead, as before the hint;
    * a forked child (a descendant, found) whose parent exited: an orphan, reparented
      to init or a subreaper, is out of the tree.  A forked child may not use the client,
      so it copies nothing through it; the creator, whose exit is waited for, is found;
    * the other way round, a HELLO naming such an orphan (a double fork of the creator)
      while the creator holds the socket and writes: the orphan's ancestors are init or a
      subreaper, not the creator, so only the orphan is waited for.  The kernel names
      neither a TCP socket's creator nor how many hold it, so only the full scan tells
      this apart; the client library says HELLO from the creator, never from a fork;
    * a process the socket was passed to by SCM_RIGHTS while the creator keeps it: the
      library never passes it; a program that does writes outside the client.

    The server's own process is never taken (as in the full scan): a hint naming it is
    not used.  A tree of more than :data:`_HINT_TREE_PROCESSES` processes, or of more than
    :data:`_HINT_TREE_THREADS` threads, is not read on (the full scan instead): a hint
    naming init, or a client forking without end, would have the walk read more than the
    full scan does, or never end while the scan worker waits."""
    if hint <= 0 or hint == os.getpid():
        return ()
    target = f"socket:[{inode}]"
    own = os.getpid()  # a descendant too where the client started the server
    found: set[int] = set()
    seen: set[int] = set()
    waiting = [hint]
    threads = _HINT_TREE_THREADS
    while waiting:
        pid = waiting.pop()
        if pid in seen:
            continue  # a pid reused while the tree was read: once is enough
        seen.add(pid)
        if len(seen) > _HINT_TREE_PROCESSES:
            return ()
        if pid != own and _holds(pid, target):
            found.add(pid)
        children = _children(pid, threads)
        if children is None:
            return ()  # a tree not read whole may miss holders: the full scan instead
        threads -= children[1]
        waiting.extend(children[0])
    if found and _ANCESTORS.hold(hint, inode, own, _HINT_TREE_PROCESSES):
        return ()
    return tuple(sorted(found))


#: the most processes, and threads, a hinted walk reads before it leaves the tree to the
#: full scan (a client and its workers are a few processes of a few hundred threads)
_HINT_TREE_PROCESSES = 64
_HINT_TREE_THREADS = 4096
#: what the ancestors of each hinted process held, read once (see :mod:`.peer_ancestors`)
_ANCESTORS = AncestorSockets()


def _children(pid: int, threads: int) -> tuple[list[int], int] | None:
    """The children of every thread of ``pid`` (none: it exited meanwhile) and how many
    threads were read; None when the kernel does not list them (no
    ``CONFIG_PROC_CHILDREN``, not ours to read) or ``pid`` has more than ``threads``."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return [], 0  # exited: it has no children to look at
    except OSError:
        return None
    if len(tasks) > threads:
        return None
    children: list[int] = []
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as listed:
                children.extend(int(child) for child in listed.read().split())
        except FileNotFoundError:
            if os.path.isdir(f"/proc/{pid}/task/{task}"):
                return None  # the thread is there but its children are not listed
        except (OSError, ValueError):
            return None
    return children, len(tasks)


def maps_file(pids: tuple[int, ...], device: int, inode: int) -> bool:
    """Whether one of the processes ``pids`` maps the file of ``device`` and ``inode``
    (``/proc/<pid>/maps``).  Read after their pidfds are opened, the maps are those of the
    processes the pidfds watch: a pid reused since names a process they do not watch.
    Inode 0 names no file (anonymous maps show ``00:00 0``): no process maps it."""
    if inode == 0:
        return False
    # A maps line: address, perms, offset, device, inode, then the path.  Compared as
    # fields: the path is any name (spaces kept), and a file named " <device> <inode> "
    # is not the file of that device and inode.
    place = (f"{os.major(device):02x}:{os.minor(device):02x}", str(inode))
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps", encoding="ascii", errors="replace") as maps:
                if any(tuple(line.split(maxsplit=5)[3:5]) == place for line in maps):
                    return True
        except OSError:
            continue  # exited, or not ours to read: not known to map it
    return False


def socket_gone(peer: PeerSocket) -> bool:
    """Whether the client's end of the loopback TCP connection ``peer`` is held by no
    process: the kernel names that very socket (its addresses) with no inode, as it does
    once every process holding it has closed it or exited (``FIN_WAIT``/``TIME_WAIT``), or
    names no such socket at all (closed by a reset, or past ``TIME_WAIT``).  False
    whenever that cannot be told (a remote peer, tables not readable).  A socket reset by
    the server's side and not listed any more may still be held by a live client: a caller
    must not take this alone for its exit."""
    if not (peer.far and peer.near) or peer.remote:
        return False
    try:
        far, near = _ip(peer.far), _ip(peer.near)
        local, remote = (far.packed, int(str(peer.far[1]))), (near.packed, int(str(peer.near[1])))
    except (ValueError, IndexError):
        return False
    answer = _diag_answer(local, remote)
    if answer is None:
        answer = _table_entry(local, remote)
    return answer is None or answer == 0


def process_exiting(pid: int) -> bool:
    """Whether process ``pid`` has begun to exit (the kernel's ``PF_EXITING`` in
    ``/proc/<pid>/stat``, set before it closes its descriptors); False when that cannot
    be read (it is gone, or not ours to read)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            # pid (comm) state ppid pgrp session tty_nr tpgid flags ...: the name may hold
            # spaces and parentheses
            flags = int(stat.read().rpartition(")")[2].split()[6])
    except (OSError, ValueError, IndexError):
        return False
    return bool(flags & _PF_EXITING)


#: task flag: the task is exiting (include/linux/sched.h)
_PF_EXITING = 0x00000004


def pidfd_exited(pidfd: int) -> bool:
    """Whether the process of ``pidfd`` has exited (its pidfd reads as ready)."""
    # poll, not select: a pidfd may be numbered past select's FD_SETSIZE (1024), where
    # select raises, and a server with many connections opens that many descriptors
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


class PeerProcess:
    """The processes of a connection, watched through pidfds: exited once all have.

    Its pidfds are closed by :meth:`close` or when it is collected; a closed watch can no
    longer tell, so it never says exited."""

    def __init__(self, pids: tuple[int, ...], pidfds: list[int]) -> None:
        self.pids = pids
        self._pidfds = pidfds
        self._closed = False
        #: False once found not to map the arena (:func:`watch_writer_socket`): not the
        #: writer of a shared-memory store, whose exit then lifts no fence
        self.writer = True

    def exited(self) -> bool:
        if self._closed:
            return False
        # each had exited before it could be watched, when there is none
        return all(pidfd_exited(pidfd) for pidfd in self._pidfds)

    def all_alive(self) -> bool:
        """Whether every process it names lives (no: one exited, even before it could be
        watched, or it is closed).  Only then does each of its pids name the process it
        watches: the pid of one that exited may be another process's by now."""
        if self._closed or len(self._pidfds) != len(self.pids):
            return False
        return not any(pidfd_exited(pidfd) for pidfd in self._pidfds)

    def close(self) -> None:
        self._closed = True
        pidfds, self._pidfds = self._pidfds, []
        for pidfd in pidfds:
            with contextlib.suppress(OSError):
                os.close(pidfd)

    def __del__(self) -> None:
        self.close()


def watch_peer(fd: int) -> PeerProcess | None:
    """Watch the processes at the other end of ``fd`` for their exit; None when they
    cannot be told (see the module), which a caller takes as "may still be running".

    A pid is read from the kernel, then a pidfd opened on it.  If the process exited
    in between and its pid went to another process, the pidfd watches that one: its exit
    comes later than the real peer's, never earlier (that one has already exited), so a
    fence waiting for it is lifted late, never while the peer may still copy."""
    return _watch_pids(peer_pids(fd))


def watch_peer_socket(peer: PeerSocket) -> PeerProcess | None:
    """:func:`watch_peer` of a connection's :func:`peer_socket`, read earlier: the scan
    and pidfds, which a server may run off its request loop.  The processes are those
    holding the connection now: one that held it and has exited is not found (the
    caller then knows none, and keeps fences as for an unknown process)."""
    return _watch_pids(peer_socket_pids(peer))


def watch_writer_socket(peer: PeerSocket, arena: tuple[int, int]) -> PeerProcess | None:
    """:func:`watch_peer_socket`, its watch marked not the ``writer`` unless one of its
    processes maps the file ``arena`` (device, inode), its maps read right after its
    pidfds were opened: one that exited meanwhile is not known to map it (fail closed)."""
    watch = watch_peer_socket(peer)
    if watch is not None and not maps_file(watch.pids, *arena):
        watch.writer = False
    return watch


def _watch_pids(pids: tuple[int, ...]) -> PeerProcess | None:
    if not pids:
        return None
    pidfds = []
    for pid in pids:
        try:
            pidfds.append(os.pidfd_open(pid))
        except ProcessLookupError:
            continue  # no such process any more: it exited, nothing to wait for
        except OSError:  # no pidfds here (an old kernel, a seccomp filter): unknown
            for pidfd in pidfds:
                os.close(pidfd)
            return None
    return PeerProcess(pids, pidfds)
