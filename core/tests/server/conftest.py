"""In-process servers (real StorageManager, L1 only unless told) on a thread; end-to-end
tests with separate processes live in tests/server."""

from lmcache_tiers.testing.server import make_server, server

__all__ = ["make_server", "server"]
