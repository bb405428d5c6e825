"""The `kvtune` command line: one subcommand module each, registered below.

Every subcommand takes `-v` (debug detail) and `-q` (warnings and errors only); by default
the tuner's notes and warnings go to stderr, results to stdout.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Each module has `register(subparsers)`, which adds its subcommand(s) with `set_defaults(func=...)`.
COMMAND_MODULES = [
    "kvtune.tuner.compile_check",   # kvtune compile-check (CUDA backend)
    "kvtune.tuner.sweep_cli",       # kvtune sweep, kvtune worker (distributed sweeps)
    "kvtune.tuner.export",          # kvtune export
    "kvtune.tuner.calibrate",       # kvtune calibrate
    "kvtune.tuner.report",          # kvtune report (review)
]


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is at the time (a test's capture, a redirected stream),
    through tqdm when it is there, so that a line does not tear a progress bar."""

    def emit(self, record):
        try:
            from tqdm import tqdm
        except ImportError:
            return super().emit(record)
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging must not raise
            self.handleError(record)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _):
        pass


class _Formatter(logging.Formatter):
    """`warning: ...` and `error: ...` as the tuner has always written them; info as it is."""

    def format(self, record):
        msg = super().format(record)
        if record.levelno >= logging.WARNING or record.levelno < logging.INFO:
            return f"{record.levelname.lower()}: {msg}"
        return msg


def configure_logging(verbose: int = 0, quiet: int = 0) -> None:
    """The `kvtune` logger's level (INFO; DEBUG with -v, WARNING with -q) and its stderr handler."""
    logger = logging.getLogger("kvtune")
    for h in [h for h in logger.handlers if isinstance(h, _StderrHandler)]:
        logger.removeHandler(h)
    handler = _StderrHandler()
    handler.setFormatter(_Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO)
    logger.propagate = False


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvtune", description="Autotune the MLA speculative-decoding verify "
                                "attention kernel and export per-deployment defaults.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for mod in COMMAND_MODULES:
        importlib.import_module(mod).register(sub)
    for sp in sub.choices.values():
        g = sp.add_mutually_exclusive_group()
        g.add_argument("-v", "--verbose", action="count", default=0, help="more detail on stderr")
        g.add_argument("-q", "--quiet", action="count", default=0, help="only warnings and errors on stderr")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    configure_logging(args.verbose, args.quiet)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"kvtune {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
