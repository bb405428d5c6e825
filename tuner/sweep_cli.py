"""`kvtune sweep` and `kvtune worker`: their command lines, and the worker processes of
`--workers N` (one `kvtune worker` per visible GPU, or N CPU processes with `--device cpu`).

One process: `tuner.sweep.Sweep`; several sharing the studies: `tuner.workers.SharedSweep`.
`--export` then runs `kvtune export` (its serving check included) on the finished sweep.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

from . import sweep, workers
from .config import ConfigError, Deployment, load_deployment, redact_url
from .executor import WorkerError
from .log import get_logger
from .options import SweepOptions, add_sweep_arguments, non_negative_int, options_from_args, positive_int
from .studies_files import journal_path
from .study import ALL_PRUNED, dead_buckets

log = get_logger(__name__)


def _export(sw, args) -> None:
    from .export import export_deployment
    export_deployment(sw.dep, out=args.out, check=True, seed=args.seed)


def _listed(results) -> str:
    return "\n".join(f"  {r.backend} tp={r.tp} bs={r.bs} ctx={r.ctx}: {r.note}" for r in results)


def _cmd_sweep(args) -> int:
    opts = options_from_args(args)
    if args.workers is not None and args.in_process:
        log.warning("--in-process: ignored with --workers (each worker process measures its own trials)")
    try:
        if args.workers is not None:
            sw = launch(args, opts, args.workers, post=True)
        else:
            sw = sweep.run_sweep(args.deployment, opts)
    except WorkerError as e:
        log.error("the trial worker failed before the sweep started: %s", e)
        return 1
    print(sw.summary())
    print(f"trials: {sw.out_dir / 'trials.csv'}   studies: {redact_url(sw.storage_url)}"
          + (f"   workers: {args.workers}" if args.workers is not None else ""))
    if not sw.results and sw.status != "interrupted":
        if sw.status.startswith("stopped") and getattr(sw, "measured_now", 0):
            # a time limit inside the first study: its trials are saved, the next run resumes them
            log.warning("no study finished before the sweep %s; its %d measurement(s) are saved: re-run the same "
                        "command to resume", sw.status, sw.measured_now)
            return 0
        log.error("no study ran (%s)", sw.status)
        return 1
    dead = set(dead_buckets(sw.results))
    every = bool(dead) and len(dead) == len({(r.tp, r.bs, r.ctx) for r in sw.results})
    pruned = [r for r in sw.results if r.all_pruned]
    gone = [r for r in pruned if (r.tp, r.bs, r.ctx) in dead]
    if gone:
        # no backend measured anything there: resuming measures nothing new, the deployment or the
        # space must change. Every bucket: nothing to export, an error; some: the rest is exported
        # (export names the gaps)
        (log.error if every else log.warning)(
            "%d bucket(s) have no measured config on any backend, every config pruned; fix the deployment or "
            "the search space, then sweep again into a new --out:\n%s", len(dead), _listed(gone))
    if len(gone) < len(pruned):   # a backend pruned out where another measured: the export's choice
        log.info("every config pruned, the bucket measured on another backend:\n%s",
                 _listed([r for r in pruned if r not in gone]))
    if every:
        return 1
    if args.export and sw.results:
        if sw.status == "complete" or sw.status.startswith(ALL_PRUNED):
            _export(sw, args)
        else:   # a half-searched bucket would replace the last good export's entry
            log.warning("--export: not exported, the sweep %s; re-run the same command to resume it (then it "
                        "exports), or `kvtune export` to export what is measured so far", sw.status)
    return 130 if sw.status == "interrupted" else 0


def _cmd_worker(args) -> int:
    opts = replace(options_from_args(args), progress=False)
    # --index is given only to the workers a sweep (or a worker with --workers) starts: the
    # sweep's own create its studies, the others' parent has waited for them
    by_hand = args.index is None
    journal = journal_path(args.storage)
    if journal is not None and by_hand and not journal.is_file():
        # `kvtune sweep --workers N` opens the journal before it starts its workers: a worker that
        # finds none was pointed at the wrong path, and would otherwise start a sweep of its own
        raise ConfigError(f"--storage {args.storage}: no such journal file; a worker joins the sweep whose "
                          "journal that is (`kvtune sweep --workers N` starts one), it does not start one")
    if args.workers:
        sw = launch(args, opts, args.workers, post=False, join=by_hand)
    else:
        sw = workers.SharedSweep(load_deployment(args.deployment), opts, args.heartbeat, args.grace,
                                 index=args.index or 0, of=args.of)
        if by_hand:
            sw.await_sweep(args.wait)
        sw.run()
    log.info("worker %s: %s, %d measurements, %d dropped as stale, %.1f s (%s)", sw.worker_id, sw.status,
             sw.measured_now, sw.dropped, sw.wall_s, redact_url(sw.storage_url))
    return 130 if sw.status == "interrupted" else 0


# --------------------------------------------------------------------------- spawning
def _worker_args(args, dep: Deployment, storage: str, device: str) -> list[str]:
    """The `kvtune worker` command line sharing this run's studies and options."""
    if not Path(str(dep.source)).is_file():
        raise ConfigError(f"deployment {dep.name}: workers need its YAML file (got {dep.source})")
    cmd = [sys.executable, "-m", "kvtune.tuner.cli", "worker", str(dep.source), "--storage", storage,
           "--device", device, "--out", args.out, "--seed", str(args.seed), "--heartbeat", str(args.heartbeat),
           "--grace", str(args.grace), "--trial-timeout", str(args.trial_timeout)]
    for flag, vals in (("--tp", args.tp), ("--ctx", args.ctx), ("--bs", args.bs), ("--backend", args.backend)):
        if vals:
            cmd += [flag, *[str(v) for v in vals]]
    for flag, val in (("--trials", args.trials), ("--timing", args.timing), ("--space-dir", args.space_dir),
                      ("--max-minutes", args.max_minutes), ("--max-measurements", args.max_measurements),
                      ("--compile-workers", args.compile_workers)):
        if val is not None:
            cmd += [flag, str(val)]
    for flag, on in (("--grid", args.grid), ("--other-device", args.other_device)):
        if on:
            cmd.append(flag)
    cmd += ["-v"] * getattr(args, "verbose", 0) + ["-q"] * getattr(args, "quiet", 0)
    return cmd


def _slots(device: str, n: int) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES of each worker (one GPU each), or None per CPU worker."""
    if n < 1:
        raise ConfigError(f"--workers {n}: at least one worker")
    if device == "cpu":
        return [None] * n
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis:
        ids = [v.strip() for v in vis.split(",") if v.strip()]
    else:
        import torch
        ids = [str(i) for i in range(torch.cuda.device_count())]
    if n > len(ids):
        raise ConfigError(f"--workers {n}: only {len(ids)} GPU(s) visible ({ids}); one worker per GPU")
    return ids[:n]


def launch(args, opts: SweepOptions, n: int, post: bool, join: bool = False) -> workers.SharedSweep:
    """Parent of `n` worker processes; then mop-up search and (post) the phases after it. `join`:
    a `kvtune worker --workers N` started by hand, which waits for the sweep's studies first."""
    dep = load_deployment(args.deployment)
    sw = workers.SharedSweep(dep, opts, args.heartbeat, args.grace, post=post)
    if join:
        sw.await_sweep(args.wait)
    base = _worker_args(args, dep, sw.storage_url, sw.device)
    slots = _slots(sw.device, n)
    cw = opts.compile_workers
    if cw is None and sw.device == "cuda":  # share the CPU cores among the workers' compile pools
        cw = max(1, min(6, (os.cpu_count() or 2) // (2 * n) - 1))
    sw.children_cmd = []
    for i, slot in enumerate(slots):
        env = dict(os.environ)
        if slot is not None:
            env["CUDA_VISIBLE_DEVICES"] = slot
        cmd = base + ["--index", str(i), "--of", str(n), "--no-progress"]
        if cw is not None and "--compile-workers" not in cmd:
            cmd += ["--compile-workers", str(cw)]
        sw.children_cmd.append((cmd, env))
    sw.run()
    return sw


# --------------------------------------------------------------------------- CLI
def register(subparsers) -> None:
    p = subparsers.add_parser("sweep", help="tune a deployment: one Optuna study per (backend, tp, bs, ctx)",
                              description=sweep.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sweep_arguments(p)
    p.add_argument("--storage", help="Optuna storage: an SQLAlchemy URL (default sqlite:///<out>/<deployment>/"
                   "studies.db, or that folder's studies.journal when only it exists) or journal:PATH; keep "
                   "passwords out of it (PGPASSWORD or ~/.pgpass)")
    p.add_argument("--remeasure-top", type=non_negative_int("--remeasure-top"), default=3,
                   help="configs per bucket re-measured against the baseline (0: none)")
    p.add_argument("--retune-stale", action="store_true",
                   help="a backend whose trials in --out were measured on another kernel source: move them to "
                        "trials.forgotten.csv, delete its studies and tune it from scratch (default: stop and say so)")
    p.add_argument("--rounds", type=non_negative_int("--rounds"), default=3,
                   help="interleaved re-measurement rounds (0: none; the search's medians pick the winners)")
    p.add_argument("--in-process", action="store_true", help="measure in this process (no fault isolation)")
    p.add_argument("--export", action="store_true",
                   help="export the YAML when the sweep completes (running the serving check, as `kvtune export`)")
    p.add_argument("--workers", type=positive_int("--workers"),
                   help="run N worker processes (one per visible GPU; N CPU processes with --device cpu) that "
                        "share the studies through the storage (default journal:<out>/<deployment>/"
                        "studies.journal; a PostgreSQL URL lets `kvtune worker` join from other hosts)")
    p.set_defaults(func=_cmd_sweep)

    p = subparsers.add_parser("worker", help="join a sweep: measure trials of its shared studies",
                              description=workers.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sweep_arguments(p, worker=True)
    p.add_argument("--storage", required=True,
                   help="the sweep's Optuna storage: journal:PATH (one host) or postgresql://... (several)")
    p.add_argument("--workers", type=positive_int("--workers"),
                   help="start this many worker processes here, one per visible GPU")
    p.add_argument("--wait", type=non_negative_int("--wait"), default=300,
                   help="seconds to wait for the sweep to create its studies in --storage before giving up "
                        "(default 300: hosts started together)")
    p.add_argument("--index", type=int, help=argparse.SUPPRESS)   # this worker's start offset
    p.add_argument("--of", type=int, default=1, help=argparse.SUPPRESS)
    p.set_defaults(func=_cmd_worker)
