"""Charts of the results pages: figures of several panels laid out to stay readable at the
site's page width.

The site shows a chart about 700-900 px wide, so a figure of many panels in one row shrinks
each to a thumbnail with unreadable labels. ``panel_grid`` wraps panels into rows of at most
``columns`` and sets a font size that stays legible once the figure is scaled to the page.
Needs matplotlib (the ``bench`` extra).
"""

from __future__ import annotations

import math
from typing import Any

#: Panels per row by default: two at the page's width keep each about 400 px wide.
COLUMNS = 2
#: One panel's size in inches (at ``DPI``, 440 x 350 px) and the text size in points.
PANEL = (4.0, 3.2)
FONT_POINTS = 9
DPI = 110


def panel_grid(
    count: int, columns: int = COLUMNS, panel: tuple[float, float] = PANEL, **subplots: Any
) -> tuple[Any, list[Any]]:
    """A figure of ``count`` panels in rows of at most ``columns`` and its axes, in order;
    the grid's unused cells are hidden. ``subplots`` go to ``plt.subplots`` (``sharey``...)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": FONT_POINTS, "legend.fontsize": FONT_POINTS - 1})
    cols = max(1, min(columns, count))
    rows = math.ceil(count / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(panel[0] * cols, panel[1] * rows), squeeze=False, **subplots
    )
    flat = list(axes.flat)
    for spare in flat[count:]:
        spare.set_visible(False)
    return fig, flat[:count]


def save(fig: Any, path: Any) -> None:
    """Lay ``fig`` out, write it to ``path`` at ``DPI`` and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
