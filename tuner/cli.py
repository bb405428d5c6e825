"""The `kvtune` command line: one subcommand module each, registered below."""
from __future__ import annotations

import argparse
import importlib
import sys

# Each module has `register(subparsers)`, which adds its subcommand(s) with `set_defaults(func=...)`.
COMMAND_MODULES = [
    "kvtune.tuner.compile_check",
    # kvtune compile-check (CUDA backend)
    # kvtune sweep / export / calibrate (tuner)
    "kvtune.tuner.sweep",
    "kvtune.tuner.export",
    "kvtune.tuner.calibrate",
    # kvtune report (review)
    "kvtune.tuner.report",
    # kvtune worker (distributed sweeps)
    "kvtune.tuner.workers",
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvtune", description="Autotune the MLA speculative-decoding verify "
                                "attention kernel and export per-deployment defaults.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for mod in COMMAND_MODULES:
        importlib.import_module(mod).register(sub)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"kvtune {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
