"""In-process servers (real StorageManager, L1 only unless told) on a thread; end-to-end
tests with separate processes live in tests/server."""

from lmcache_tiers.testing.server import make_server, server
from lmcache_tiers.testing.threads import new_threads

__all__ = ["make_server", "new_threads", "server"]
