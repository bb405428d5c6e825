"""The tuner's optional libraries (the `tune` extra: optuna, pandas): one error, naming the
extra to install, wherever a command finds one missing.

The kernels and the serving runtime never import these (tests/test_import_hygiene.py), so
they are imported only where a tuner command needs them.
"""
from __future__ import annotations

import importlib

TUNE_EXTRA = "install the tuner extra: pip install 'kvtune[tune]'"


class MissingExtra(ValueError):
    """An optional library a command needs is not installed. A ValueError so that `kvtune`
    prints it as the command's error (tuner/cli.py) instead of a traceback."""


def tune_module(name: str, needed_by: str):
    """The module `name` of the tune extra; `needed_by` (a command or a file) names who needs it."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise MissingExtra(f"{needed_by} needs {name} ({e}); {TUNE_EXTRA}") from None
