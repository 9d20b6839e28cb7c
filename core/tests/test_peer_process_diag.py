"""A loopback TCP client's socket inode, asked of the kernel by address (sock_diag) and
read from /proc/net/tcp{,6} (the fallback): both name the client's socket, over IPv4,
IPv6 and dual-stack sockets, and none for addresses no socket has."""

from __future__ import annotations

import errno
import os
import socket
import struct

import pytest

from lmcache_tiers.peer_process import (
    _DIAG_REQUEST,
    _DIAG_SOCKID,
    _NETLINK_SOCK_DIAG,
    _NLMSG,
    _NO_COOKIE,
    _SOCK_DIAG_BY_FAMILY,
    _diag_inode,
    _ip,
    _table_inode,
    _tcp_inode,
)

#: (listener family, its address, client family, the address it connects to)
PAIRS = [
    (socket.AF_INET, "127.0.0.1", socket.AF_INET, "127.0.0.1"),
    (socket.AF_INET, "127.0.0.1", socket.AF_INET6, "::ffff:127.0.0.1"),
    (socket.AF_INET6, "::1", socket.AF_INET6, "::1"),
    (socket.AF_INET6, "::", socket.AF_INET, "127.0.0.1"),
    (socket.AF_INET6, "::", socket.AF_INET6, "::ffff:127.0.0.1"),
]


@pytest.mark.parametrize(("family", "address", "client_family", "client_address"), PAIRS)
def test_the_client_socket_inode_is_found_by_address(
    family: int, address: str, client_family: int, client_address: str
) -> None:
    with socket.socket(family) as listener:
        listener.bind((address, 0))
        listener.listen()
        with socket.socket(client_family) as client:
            client.connect((client_address, listener.getsockname()[1]))
            accepted, _ = listener.accept()
            with accepted:
                far, near = accepted.getpeername(), accepted.getsockname()
                local = (_ip(far).packed, int(far[1]))
                remote = (_ip(near).packed, int(near[1]))
                inode = os.fstat(client.fileno()).st_ino
                assert _diag_inode(local, remote) == inode
                assert _table_inode(local, remote) == inode
                # the server's own end is another socket, and a port off by one names none
                assert _diag_inode(remote, local) == os.fstat(accepted.fileno()).st_ino
                assert _table_inode(local, (remote[0], remote[1] ^ 1)) == 0
                assert _tcp_inode(local, (remote[0], remote[1] ^ 1)) == 0


def test_no_such_socket_is_told_by_the_table_not_by_the_kernel_s_enoent() -> None:
    # The kernel answers ENOENT both for a socket that is not there and where it has no
    # sock_diag handler for the protocol (asked here of one no handler serves): the same
    # bytes, so ENOENT cannot say "no such socket" -- the table is read instead.
    assert _diag_error(protocol=250) == -errno.ENOENT
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        with socket.create_connection(listener.getsockname()):
            accepted, _ = listener.accept()
            with accepted:
                far, near = accepted.getpeername(), accepted.getsockname()
                local = (_ip(far).packed, int(far[1]))
                absent = (_ip(near).packed, int(near[1]) ^ 1)
                assert _diag_error(protocol=socket.IPPROTO_TCP, local=local, remote=absent) == -errno.ENOENT
                assert _diag_inode(local, absent) is None
                assert _tcp_inode(local, absent) == 0


def _diag_error(
    protocol: int,
    local: tuple[bytes, int] = (b"\x7f\0\0\1", 1),
    remote: tuple[bytes, int] = (b"\x7f\0\0\1", 2),
) -> int:
    """The error the kernel answers a sock_diag lookup of an IPv4 socket of ``protocol``
    with (0: it answered with a socket)."""
    wanted = _DIAG_SOCKID.pack(
        local[1], remote[1], local[0].ljust(16, b"\0"), remote[0].ljust(16, b"\0"), 0, _NO_COOKIE
    )
    request = _DIAG_REQUEST.pack(socket.AF_INET, protocol, 0, 0, 0xFFFFFFFF) + wanted
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as diag:
        diag.settimeout(10)
        diag.send(_NLMSG.pack(_NLMSG.size + len(request), _SOCK_DIAG_BY_FAMILY, 1, 1, 0) + request)
        answer = diag.recv(65536)
    if _NLMSG.unpack_from(answer)[1] != 2:  # NLMSG_ERROR
        return 0
    return int(struct.unpack_from("=i", answer, _NLMSG.size)[0])
