"""``python -m speedups.lint PATH... [--diff | --write]``: which tips a training script needs, where.

Reads the source only: nothing is imported or run. Exit status 0 when no tip applies, 1 when one does, 2 when
a file cannot be read or parsed (the others are still checked).
"""

from __future__ import annotations

import argparse
import sys

from speedups.lint.report import lint_paths
from speedups.lint.rewrite import rewrite_paths

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m speedups.lint",
        description="Read training scripts (never run them) and say which speedups tips apply, where.",
    )
    parser.add_argument("paths", nargs="+", help="scripts, or folders of .py files")
    parser.add_argument("--diff", action="store_true", help="print a unified diff of the mechanical upgrades")
    parser.add_argument(
        "--write", action="store_true", help="apply them to the files (each kept as FILE.orig)"
    )
    args = parser.parse_args(argv)
    status, _ = lint_paths(args.paths, sys.stdout if not args.diff else sys.stderr)
    if args.diff or args.write:
        rewrite_paths(args.paths, write=args.write, out=sys.stdout)
    return status


if __name__ == "__main__":
    sys.exit(main())
