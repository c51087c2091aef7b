"""The PNG plots the tools write (sweeps, suite scores, ablations, the gradient bottleneck):
one figure helper and one "a line per series" helper, on matplotlib's file-only backend."""

from __future__ import annotations

import contextlib
from pathlib import Path

from cplm_dist.errors import UsageError


@contextlib.contextmanager
def figure(path: str | Path, ncols: int = 1, size: tuple[float, float] = (5, 3.5)):
    """Axes (one, or a tuple of ncols) for a PNG written to `path` when the block ends."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("plots need matplotlib: pip install -e '.[bench]'") from None
    fig, axes = plt.subplots(1, ncols, figsize=size)
    try:
        yield axes
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)


def lines(ax, series: dict[str, list[tuple]], **labels) -> None:
    """One marked line per series {label: [(x, y), ...]}; a legend when there are several."""
    for label, points in series.items():
        ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=label or None)
    ax.set(**labels)
    if len(series) > 1:
        ax.legend(fontsize=7)
