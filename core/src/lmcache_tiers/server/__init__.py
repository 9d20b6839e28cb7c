"""The serving process: start-up and shutdown of the storage, the front ends and HTTP.

Start a server with :func:`lmcache_tiers.server.app.run_server` (what ``lmcache-tiers
serve`` calls).  The wire protocols themselves are front-end plugins
(:mod:`lmcache_tiers.frontend`); the native one is ``lmcache-plugin-frontend-native``.
"""
