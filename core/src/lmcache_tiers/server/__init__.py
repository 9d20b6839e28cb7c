"""The native RPC server: protocol, request loop, shared-memory data plane and HTTP endpoint.

Start a server with :func:`lmcache_tiers.server.app.run_server` (what ``lmcache-tiers
serve`` calls) and talk to it with :class:`lmcache_tiers.client.Client`.
"""
