"""The server process's log format: one per event, timestamped, on stderr, for core and
every plugin's package alike."""

from __future__ import annotations

import logging
import os

__all__ = ["LOG_LEVEL_ENV", "configure_logging"]

logger = logging.getLogger("lmcache_tiers.server.app")

LOG_LEVEL_ENV = "LMCACHE_LOG_LEVEL"
#: LMCache's own levels: an engine's environment set for LMCache means the same here
_LEVELS = {
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARNING": logging.WARNING,
    "ERROR": logging.ERROR,
    "CRITICAL": logging.CRITICAL,
}


def configure_logging() -> None:
    """One log format for every Python logger of the server process, on stderr.

    The handler sits on the root logger, so plugin loggers (``lmcache_plugin_nixl.*``, a
    third-party plugin's package) and libraries print with the same timestamp, level and
    logger name as core.  ``LMCACHE_LOG_LEVEL`` (INFO when unset) applies to
    ``lmcache_tiers`` and to the package of every plugin entry point; other libraries keep
    Python's WARNING.  A process that configured logging itself (root already has a
    handler) keeps its handlers.  Log lines are plain, one per event: they end up in files
    and journals that people grep, unlike the banner and summary, which are for a terminal.
    """
    from importlib.metadata import entry_points

    from lmcache_tiers.plugins import ENTRY_POINT_GROUP

    raw = os.environ.get(LOG_LEVEL_ENV, "INFO").strip().upper()
    level = _LEVELS.get(raw)
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
    packages = {"lmcache_tiers"}
    packages.update(ep.value.split(":")[0].split(".")[0] for ep in entry_points(group=ENTRY_POINT_GROUP))
    for name in sorted(packages):
        logging.getLogger(name).setLevel(level if level is not None else logging.INFO)
    if level is None:
        logger.warning("%s=%r is not one of %s; using INFO", LOG_LEVEL_ENV, raw, ", ".join(_LEVELS))
