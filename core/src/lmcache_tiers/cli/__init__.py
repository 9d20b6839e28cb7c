"""The ``lmcache-tiers`` command line (typer + rich)."""
