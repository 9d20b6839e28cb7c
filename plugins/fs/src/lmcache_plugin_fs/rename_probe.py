"""Whether a record written in a local ``relative_tmp_dir`` can be published in the root.

A store writes its record in the temporary directory and renames it over its name under
the root.  A temporary directory on another filesystem (a mount point, or a symbolic link
to another disk) makes every such rename fail with EXDEV: no store would ever succeed,
each failure counted at run time.  That is a mistake of the configuration, so the start
refuses it, having renamed one empty file across the way a store would."""

from __future__ import annotations

import contextlib
import errno
import os

from lmcache_tiers.plugin import ConfigError


def check_renames_into_root(temp_dir: str, root: str) -> None:
    """ConfigError when a file in ``temp_dir`` cannot be renamed into ``root`` because
    the two are on different filesystems.  Any other failure of the probe (a full or
    read-only disk) is left to the stores, which count and log theirs; the probe's
    names are temporary names (``.tmp-*.part``), which the next start sweeps if this
    process dies before it removes them."""
    name = f".tmp-{os.getpid()}-rename-probe.part"
    source, target = os.path.join(temp_dir, name), os.path.join(root, name)
    try:
        os.close(os.open(source, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644))
    except OSError:
        return
    try:
        os.rename(source, target)
    except OSError as exc:
        if exc.errno == errno.EXDEV:
            raise ConfigError(
                f"fs: relative_tmp_dir {temp_dir} is on another filesystem than the root {root}: "
                "no record written there can be renamed into the root; give a directory on the "
                "root's filesystem, or leave relative_tmp_dir unset"
            ) from None
    finally:
        for path in (source, target):
            with contextlib.suppress(OSError):
                os.unlink(path)
