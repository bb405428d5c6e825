"""The `kvtune` command line: one subcommand module each, registered below.

Every subcommand takes `-v` (debug detail) and `-q` (warnings and errors only); by default
the tuner's notes and warnings go to stderr, results to stdout.
"""
from __future__ import annotations

import argparse
import difflib
import importlib
import signal
import sys

from .log import set_level

# Each module has `register(subparsers)`, which adds its subcommand(s) with `set_defaults(func=...)`.
COMMAND_MODULES = [
    "kvtune.tuner.compile_check",   # kvtune compile-check (CUDA backend)
    "kvtune.tuner.sweep_cli",       # kvtune sweep, kvtune worker (distributed sweeps)
    "kvtune.tuner.export",          # kvtune export
    "kvtune.tuner.forget",          # kvtune forget (a backend's trials, after its kernel changed)
    "kvtune.tuner.calibrate",       # kvtune calibrate
    "kvtune.tuner.report",          # kvtune report (review)
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvtune", description="Autotune the MLA speculative-decoding verify "
                                "attention kernel and export per-deployment defaults.", allow_abbrev=False)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for mod in COMMAND_MODULES:
        importlib.import_module(mod).register(sub)
    for sp in sub.choices.values():
        # no prefix of an option stands for it: `--dev` would be --device today and an error, or
        # another option, once a second option starting so exists (read at parse time)
        sp.allow_abbrev = False
        g = sp.add_mutually_exclusive_group()
        g.add_argument("-v", "--verbose", action="count", default=0, help="more detail on stderr")
        g.add_argument("-q", "--quiet", action="count", default=0, help="only warnings and errors on stderr")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:   # said by the subcommand's own parser, with its usage and the nearest option
        _unknown_arguments(parser, args.command, extra)
    if args.command is None:   # a usage error, as argparse treats one: a script calling plain `kvtune` fails
        parser.print_help(sys.stderr)
        return 2
    set_level(args.verbose, args.quiet)
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError) as e:   # OSError's text names the path (permission, a folder for a file, ...)
        print(f"kvtune {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:   # the sweep handles its own; any other command has nothing half-written to keep
        print(f"kvtune {args.command}: interrupted", file=sys.stderr)
        return 130


def _unknown_arguments(parser: argparse.ArgumentParser, command: str | None, extra: list[str]) -> None:
    """Exit 2 naming the arguments no parser took: through the subcommand's parser (its usage,
    not the top level's), with the nearest option of that subcommand for an option typed wrong."""
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    target = sub.choices.get(command, parser) if sub is not None and command else parser
    known = [o for a in target._actions for o in a.option_strings if o.startswith("--")]
    hints = []
    for x in extra:
        name = x.split("=", 1)[0]
        close = difflib.get_close_matches(name, known, n=1) if x.startswith("-") else []
        if close:
            hints.append(f"{name}: did you mean {close[0]}?")
    target.error("unrecognized arguments: " + " ".join(extra) + ("; " + "; ".join(hints) if hints else ""))


def entry() -> None:
    """The `kvtune` command: `main`, then the exit with Ctrl-C ignored. A second SIGINT (a
    second Ctrl-C, or `timeout -s INT`, which signals the command and then its process group)
    would otherwise land in the interpreter's exit handlers and print a traceback after the
    command has already said it was interrupted and saved its work."""
    code = main()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(code)


if __name__ == "__main__":
    entry()
