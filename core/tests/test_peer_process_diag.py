"""A loopback TCP client's socket inode, asked of the kernel by address (sock_diag) and
read from /proc/net/tcp{,6} (the fallback): both name the client's socket, over IPv4,
IPv6 and dual-stack sockets, and none for addresses no socket has."""

from __future__ import annotations

import os
import socket

import pytest

from lmcache_tiers.peer_process import _diag_inode, _ip, _table_inode

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
                assert _diag_inode(local, (remote[0], remote[1] ^ 1)) == 0
                assert _table_inode(local, (remote[0], remote[1] ^ 1)) == 0
