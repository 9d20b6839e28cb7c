"""``--plot FILE``: the miss-ratio curve drawn with matplotlib (extra ``plot``), as PNG, SVG
or PDF by the file's extension."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from lmcache_tiers.errors import ConfigError
from lmcache_tiers.replay.report import policy_names
from lmcache_tiers.replay.simulate import BELADY, INFINITE, CapacityPoint

#: the formats --plot writes, by file extension (matplotlib draws them without extra tools)
PLOT_FORMATS = ("png", "svg", "pdf")
_NO_MATPLOTLIB = "--plot needs matplotlib, which is not installed: pip install 'lmcache-tiers[plot]'"


#: characters of the --plot file's name that name the partial file beside it (at most 128
#: bytes in UTF-8, well within any file system's limit with the rest of that name)
_NAME_HEAD = 32


def _new_file_beside(path: str | Path) -> str:
    """A new, empty file in the directory of ``path``, with the mode a plain ``open`` would
    give it (the umask's): the plot is drawn there and then renamed over ``path``, so that a
    signal or a full disk mid-write leaves no half-written image behind."""
    directory, name = os.path.split(os.path.abspath(path))
    extension = os.path.splitext(name)[1]
    # The head of the name only: the whole of a long one (up to the file system's 255 bytes)
    # plus what marks the file as partial is a name too long, refusing a valid --plot.
    stem = name[:_NAME_HEAD]
    fd, temporary = tempfile.mkstemp(prefix=f".{stem}.", suffix=f".partial{extension}", dir=directory)
    try:
        umask = os.umask(0o022)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
    finally:
        os.close(fd)
    return temporary


def written_file(path: str | Path) -> str:
    """The file ``--plot path`` writes: ``path``, or the file a symbolic link there points
    at (written through, as a plain ``open`` would; replacing the link with the image
    would cut it from wherever it pointed)."""
    return os.path.realpath(path)


def check_plot_path(path: str) -> None:
    """Refuse, before any simulation runs, a ``--plot`` file that cannot be written: one
    without a supported extension (nothing is appended to a name), a directory, one in a
    directory that does not exist or where no file can be created (read-only, /proc); and
    matplotlib not installed.  A symbolic link is judged by the file it points at."""
    if not path:
        # an unset variable (--plot "$OUT"), not a request for no plot: that drew nothing
        raise ConfigError("--plot '' names no file; leave it out for no plot")
    extension = os.path.splitext(path)[1].lower().lstrip(".")
    if extension not in PLOT_FORMATS:
        *others, last = (f".{name}" for name in PLOT_FORMATS)
        raise ConfigError(
            f"--plot {path}: give a file name ending in {', '.join(others)} or {last} (the format follows it)"
        )
    target = written_file(path)
    through = "" if target == os.path.abspath(path) else f" (a link to {target})"
    if os.path.isdir(target):
        raise ConfigError(f"--plot {path}{through}: is a directory; give a file name")
    parent = os.path.dirname(target)
    if not os.path.isdir(parent):
        raise ConfigError(f"--plot {path}{through}: directory {parent} does not exist")
    try:
        # as the plot is written at the end, where a refusal would throw the simulation away
        os.unlink(_new_file_beside(target))
    except OSError as exc:
        raise ConfigError(f"--plot {path}: cannot create a file in {parent}: {exc.strerror or exc}") from None
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError(_NO_MATPLOTLIB) from None


def plot_curve(points: Sequence[CapacityPoint], path: str | Path, *, title: str) -> None:
    """Write miss ratio against capacity (log scale), one line per policy."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError(_NO_MATPLOTLIB) from None
    capacities = [point.capacity_blocks + (point.l2_capacity_blocks or 0) for point in points]
    figure, axes = plt.subplots(figsize=(8, 5))
    for name in policy_names(points):
        ratios = [point.run(name).miss_ratio for point in points]
        if name == INFINITE:
            axes.axhline(ratios[0], color="grey", linestyle=":", label="infinite cache")
        elif name == BELADY:
            axes.plot(capacities, ratios, color="black", linestyle="--", marker=".", label="Belady (optimal)")
        else:
            axes.plot(capacities, ratios, marker="o", markersize=3, label=name)
    axes.set_xscale("log")
    axes.set_xlabel(
        "capacity (blocks)"
        if all(p.l2_capacity_blocks is None for p in points)
        else "L1 + L2 capacity (blocks)"
    )
    axes.set_ylabel("miss ratio (blocks)")
    axes.set_ylim(0.0, 1.0)
    axes.grid(True, which="both", alpha=0.3)
    axes.set_title(title)
    axes.legend(fontsize="small")
    figure.tight_layout()
    temporary: str | None = None
    try:
        target = written_file(path)
        temporary = _new_file_beside(target)
        figure.savefig(temporary, dpi=120, format=os.path.splitext(path)[1].lower().lstrip("."))
        os.replace(temporary, target)
    except BaseException as exc:
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
        if isinstance(exc, OSError):
            raise ConfigError(f"cannot write the plot to {path}: {exc.strerror or exc}") from None
        raise
    finally:
        plt.close(figure)
