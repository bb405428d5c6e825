"""The tuner's messages: every `kvtune.tuner.*` logger writes to stderr through one handler.

Warnings are shown by default, also to Python callers of the tuner (an export that names a
missing bucket says so on stderr whoever calls it); the command line sets the level: INFO
(notes) by default, DEBUG with `-v`, WARNING with `-q` (`set_level`). Lines read
`warning: ...`, `error: ...`, notes as written; they go through tqdm when it is installed, so
that a line never tears a progress bar. The kernels' loggers (`kvtune.kernels.*`) are left
to the application that serves them.
"""
from __future__ import annotations

import logging
import sys

ROOT = "kvtune.tuner"


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is at the time (a test's capture, a redirected stream)."""

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
    def format(self, record):
        msg = super().format(record)
        if record.levelno >= logging.WARNING or record.levelno < logging.INFO:
            return f"{record.levelname.lower()}: {msg}"
        return msg


def _install() -> logging.Logger:
    root = logging.getLogger(ROOT)
    if not any(isinstance(h, _StderrHandler) for h in root.handlers):
        handler = _StderrHandler()
        handler.setFormatter(_Formatter("%(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.WARNING)
        root.propagate = False
    return root


def get_logger(name: str) -> logging.Logger:
    """The logger of tuner module `name` (its messages reach stderr as above)."""
    _install()
    return logging.getLogger(name)


def set_level(verbose: int = 0, quiet: int = 0) -> None:
    """INFO; DEBUG with `verbose`, WARNING with `quiet` (the command line's -v and -q)."""
    _install().setLevel(logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO)
