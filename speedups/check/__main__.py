"""``python -m speedups.check PATH... [--diff | --write]``: which tips a training script needs, where.

Reads the source only: nothing is imported or run. Exit status 0 when no tip applies, 1 when one does, 2 when
a file cannot be read or parsed (the others are still checked).
"""

from __future__ import annotations

import argparse
import sys

from speedups.check.report import check_paths
from speedups.check.rewrite import rewrite_paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m speedups.check",
        description="Read training scripts (never run them) and say which speedups tips apply, where.",
    )
    parser.add_argument("paths", nargs="+", help="scripts, or folders of .py files")
    parser.add_argument("--diff", action="store_true", help="print a unified diff of the mechanical upgrades")
    parser.add_argument(
        "--write", action="store_true", help="apply them to the files (each kept as FILE.orig)"
    )
    args = parser.parse_args(argv)
    status, _ = check_paths(args.paths, sys.stdout if not args.diff else sys.stderr)
    if args.diff or args.write:
        rewrite_paths(args.paths, write=args.write, out=sys.stdout)
    return status


if __name__ == "__main__":
    sys.exit(main())
