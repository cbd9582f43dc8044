"""Draw a run's logged curves to a PNG: ``python -m speedups.plot RUN_DIR_OR_CSV -o curves.png``.

The command line of :func:`~speedups.plot_metrics` (kept out of the package's imports, so that ``python -m``
runs it without a warning).
"""

from __future__ import annotations

import argparse
import sys

from speedups.metrics.curves import plot_metrics

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """``python -m speedups.plot RUN_DIR_OR_CSV [-o curves.png]``: draw the curves, print the PNG's path."""
    parser = argparse.ArgumentParser(prog="python -m speedups.plot", description=main.__doc__)
    parser.add_argument("source", help="a MetricLogger log_dir, or its metrics.csv / metrics.jsonl")
    parser.add_argument("-o", "--output", default=None, help="the PNG (default: curves.png beside the file)")
    args = parser.parse_args(argv)
    print(plot_metrics(args.source, args.output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
