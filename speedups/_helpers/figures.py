"""A matplotlib figure of its own, on the Agg canvas: the process's backend and pyplot's figures untouched."""

from __future__ import annotations

from typing import Any

__all__ = ["agg_figure"]


def agg_figure(figsize: tuple[float, float], *, needed_by: str) -> Any:
    """A new ``matplotlib.figure.Figure`` rendered by Agg (``savefig`` works whatever the backend).

    Raises:
        ImportError: matplotlib is not installed; the message names ``needed_by`` and the extra.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(
            f"{needed_by} needs matplotlib, which is not installed. "
            f"Install it with `pip install 'speedups[examples]'` (or `pip install matplotlib`)."
        ) from None
    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)  # attaches itself as fig.canvas
    return fig
