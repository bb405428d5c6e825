#!/usr/bin/env python3
"""Which modules of kvtune's install do not import, by group (the package and pyproject.toml's
extras). Used by scripts/setup.sh (the package and `tune`, which the sweep needs, must import;
`test` and `review` are reported) and scripts/test.sh (every group: a missing extra would
otherwise only show up as skipped tests).

    python scripts/check_install.py package tune [test review]   # exit 1, naming each, if any fails
"""
from __future__ import annotations

import importlib
import sys

GROUPS = {
    "package": ["kvtune.kernels", "kvtune.tuner", "torch", "triton", "yaml", "cuda.bindings.nvrtc"],
    "tune": ["optuna", "pandas", "tqdm"],
    "test": ["pytest", "xdist", "pytest_timeout", "psycopg2", "ruff"],
    "review": ["matplotlib", "nbconvert", "nbclient", "ipykernel", "jinja2"],
}


def missing(groups: list[str]) -> list[str]:
    bad = []
    for g in groups:
        for m in GROUPS[g]:
            try:
                importlib.import_module(m)
            except Exception as e:  # noqa: BLE001 - any failure to import is a broken install
                bad.append(f"{m} ({g}: {type(e).__name__}: {e})")
    return bad


def main(argv: list[str]) -> int:
    unknown = [g for g in argv if g not in GROUPS]
    if not argv or unknown:
        print(f"check_install.py: give groups from {list(GROUPS)}; got {argv}", file=sys.stderr)
        return 2
    bad = missing(argv)
    if bad:
        print("kvtune: cannot import " + "; ".join(bad), file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
