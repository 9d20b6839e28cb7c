"""``--plot FILE.png``: the miss-ratio curve drawn with matplotlib (extra ``plot``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from lmcache_tiers.errors import ConfigError
from lmcache_tiers.replay.report import policy_names
from lmcache_tiers.replay.simulate import BELADY, INFINITE, CapacityPoint


def plot_curve(points: Sequence[CapacityPoint], path: str | Path, *, title: str) -> None:
    """Write miss ratio against capacity (log scale), one line per policy."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError(
            "--plot needs matplotlib, which is not installed: pip install 'lmcache-tiers[plot]'"
        ) from None
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
    try:
        figure.savefig(path, dpi=120)
    except OSError as exc:
        raise ConfigError(f"cannot write the plot to {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(figure)
