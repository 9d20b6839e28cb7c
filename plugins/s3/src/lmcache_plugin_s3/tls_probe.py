"""Whether the service behind a plain ``http://`` endpoint speaks TLS.

A TLS-only service answers a plain HTTP request with a bare 400 (Go's servers, SeaweedFS's
gateway among them) or by closing the connection: to the S3 client that reads as a service
that does not answer, and the adapter would start and fail every request until the
configuration changes.  A completed TLS handshake on the same port proves the scheme is
the mistake.  Nothing is sent over it, so its certificate is not checked.
"""

from __future__ import annotations

import socket
import ssl
import urllib.parse


def speaks_tls(url: str, timeout_s: float) -> bool:
    """True once a TLS handshake with ``url``'s host and port completed."""
    try:
        parts = urllib.parse.urlsplit(url)
        host, port = parts.hostname, parts.port or 80
    except ValueError:
        return False
    if not host:
        return False
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with (
            socket.create_connection((host, port), timeout=timeout_s) as raw,
            context.wrap_socket(raw, server_hostname=host),
        ):
            return True
    except OSError:  # refused, timed out, or no TLS there (ssl.SSLError is an OSError)
        return False
