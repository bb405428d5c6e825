"""`kvtune report DEPLOYMENT_OR_RESULTS_DIR`: the sweep review as a static HTML page.

Writes `index.html` and one PNG per figure (default into `<results>/report/`): the same
sections as `results/review.ipynb`, built by the same functions (`kvtune.tuner.review`).
Needs the `kvtune[review]` extra; it is imported only when the command runs, so
`kvtune --help` works without it.
"""
from __future__ import annotations

import argparse


def _cmd_report(args) -> int:
    try:
        import matplotlib
        import pandas  # noqa: F401
    except ImportError as e:
        raise ValueError(f"needs the review extra ({e.name} is missing): pip install 'kvtune[review]'") from None
    matplotlib.use("Agg")  # files only: never open a window, work without a display
    from pathlib import Path

    from .review import resolve_results_dir, write_report
    out = args.out
    if out is None:
        folder = resolve_results_dir(args.target)
        if git_tracked(folder):   # committed evidence is rewritten only when --out names it
            out = Path("runs") / folder.name / "report"
            print(f"note: {folder} holds committed files; writing the report to {out} "
                  f"(--out {folder / 'report'} to replace the committed one)")
    page = write_report(args.target, out, storage=args.storage)
    pngs = sorted(p.name for p in page.parent.glob("*.png"))
    print(f"wrote {page} ({len(pngs)} plots: {', '.join(pngs)})")
    return 0


def git_tracked(folder) -> bool:
    """Whether git tracks any file under `folder` (False outside a repository or without git)."""
    import subprocess
    try:
        r = subprocess.run(["git", "-C", str(folder), "ls-files", "--", "."], capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0 and bool(r.stdout.strip())


def register(subparsers) -> None:
    p = subparsers.add_parser("report", help="write the review of a sweep as a static HTML page with PNG plots",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", metavar="DEPLOYMENT_OR_RESULTS_DIR",
                   help="a results folder (results/<deployment>), a deployment name, or a deployment YAML")
    p.add_argument("--out", help="output folder (default <results folder>/report; runs/<deployment>/report when "
                   "git tracks the results folder, so committed evidence changes only when named)")
    p.add_argument("--storage", help="Optuna storage URL of the studies, when not the folder's studies.db "
                                     "(histories and importances; without one they come from the trials table)")
    p.set_defaults(func=_cmd_report)
