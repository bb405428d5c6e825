"""What a sweep is asked to do: `SweepOptions`, their checks, and the command-line flags that
`kvtune sweep` and `kvtune worker` share (one definition, one translation into options)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from .config import ConfigError, Deployment
from .strategy import DEFAULT as DEFAULT_STRATEGY
from .strategy import SearchStrategy


@dataclass
class SweepOptions:
    tps: list[int] | None = None
    ctxs: list[int] | None = None
    bss: list[int] | None = None
    backends: list[str] | None = None
    trials: int | None = None
    storage: str | None = None
    timing: str | None = None
    seed: int = 0
    device: str | None = None
    out: str = "runs"
    space_dir: str | None = None
    remeasure_top: int = 3
    rounds: int = 3
    isolate: bool = True
    trial_timeout_s: float = 600.0
    progress: bool = True
    max_measurements: int | None = None   # stop (as Ctrl-C would) after this many measurements
    max_minutes: float | None = None      # stop (as Ctrl-C would) once this much wall time is spent
    reclaim_running: bool = True          # single worker: trials left RUNNING were interrupted
    grid: bool = False                    # sweep every feasible config (exhaustive; for checking TPE)
    compile_workers: int | None = None    # processes compiling configs ahead (default: 0 on CPU, ~cores/2 on GPU)
    measure_overrides: dict = field(default_factory=dict)
    strategy: SearchStrategy = DEFAULT_STRATEGY   # how a study picks configs (tuner/strategy.py)
    retune_stale: bool = False            # a backend's trials on another kernel source: forget them, re-tune
    other_device: bool = False            # sweep on a GPU other than the deployment's device profile names


def check_options(opts: SweepOptions, dep: Deployment) -> None:
    """Options the command line cannot check alone (and the same checks for the Python API):
    a bad value is an error naming it, never a sweep that does nothing and reports success."""
    from kvtune.kernels.backends import backend_names
    if opts.trials is not None and (isinstance(opts.trials, bool) or not isinstance(opts.trials, int)
                                    or opts.trials < 1):
        raise ConfigError(f"--trials: expected a positive integer, got {opts.trials!r}")
    if opts.max_minutes is not None and not 0 <= opts.max_minutes < float("inf"):
        raise ConfigError(f"--max-minutes: expected a finite number of minutes >= 0, got {opts.max_minutes!r}")
    known = backend_names()
    for be in opts.backends or ():
        if be not in known:
            raise ConfigError(f"--backend: unknown backend {be!r}; known: {known}")
    for be in dep.backends if not opts.backends else ():
        if be not in known:
            raise ConfigError(f"{dep.source}: backends: unknown backend {be!r}; known: {known}")


def subset(sel, allowed, flag, src, allow_extra=False) -> list:
    """The values of `flag` (all of `allowed` when not given); one outside `allowed` is an
    error naming the deployment file `src`, unless `allow_extra`."""
    if not sel:
        return list(allowed)
    bad = [v for v in sel if v not in allowed]
    if bad and not allow_extra:
        raise ConfigError(f"{flag}: {bad} not in the deployment's values {list(allowed)} ({src})")
    return list(dict.fromkeys(sel))


def _checked(flag, cast, ok, expected):
    """argparse type: `cast(text)` where `ok` holds, else an error saying what `flag` expects
    (argparse puts "argument <flag>: " in front of it)."""
    def parse(text):
        try:
            v = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
        return v
    return parse


def positive_int(flag):
    return _checked(flag, int, lambda v: v >= 1, "a positive integer")


def int_in(flag, lo: int, hi: int, what: str):
    return _checked(flag, int, lambda v: lo <= v <= hi, f"{what} in {lo}..{hi}")


def non_negative_int(flag):
    return _checked(flag, int, lambda v: v >= 0, "an integer >= 0")


def positive_seconds(flag):
    return _checked(flag, float, lambda v: 0 < v < float("inf"), "a finite number of seconds > 0")


def non_negative_minutes(flag):
    return _checked(flag, float, lambda v: 0 <= v < float("inf"), "a finite number of minutes >= 0")


def add_sweep_arguments(p, worker: bool = False) -> None:
    """The flags `kvtune sweep` and `kvtune worker` share (the worker's help is terser: it is
    started with the sweep's own values)."""
    p.add_argument("deployment", help="deployment YAML (or its name under configs/deployments/)")
    p.add_argument("--tp", type=int, nargs="+", help=None if worker else "only these tp degrees")
    p.add_argument("--ctx", type=int, nargs="+", help=None if worker else "only these context buckets")
    p.add_argument("--bs", type=int, nargs="+", help=None if worker else "only these batch buckets")
    p.add_argument("--backend", nargs="+", help=None if worker else "only these backends")
    p.add_argument("--trials", type=positive_int("--trials"),
                   help="trial budget per study (default: the deployment's)")
    p.add_argument("--timing", choices=("graph", "eager"),
                   help=None if worker else "CUDA timing mode (default: the deployment's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("cuda", "cpu"),
                   help=None if worker else "default: cuda when a GPU is visible, else cpu")
    p.add_argument("--out", default="runs", help="output root (default ./runs)" if worker else
                   "output root (default ./runs; the committed evidence under results/ is written only when named)")
    p.add_argument("--space-dir", help=None if worker else
                   "search-space folder (default: the repository's search_spaces/)")
    p.add_argument("--trial-timeout", type=positive_seconds("--trial-timeout"), default=600.0,
                   help=None if worker else "seconds before a trial's worker is killed")
    p.add_argument("--compile-workers", type=non_negative_int("--compile-workers"), help=None if worker else
                   "processes compiling configs ahead of the measurement (default 0 on CPU, ~cores/2 on GPU)")
    p.add_argument("--grid", action="store_true", help=None if worker else
                   "measure every feasible config (exhaustive grid; to check TPE against, use another --out)")
    p.add_argument("--max-minutes", type=non_negative_minutes("--max-minutes"),
                   help=None if worker else "stop (resumably, like Ctrl-C) after this much wall time")
    p.add_argument("--max-measurements", type=non_negative_int("--max-measurements"),
                   help=None if worker else "stop (resumably, like Ctrl-C) after this many measurements in this run "
                   "(with --workers: in each worker)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--heartbeat", type=positive_int("--heartbeat"), default=10,
                   help="seconds between a worker's heartbeats (default 10)")
    p.add_argument("--other-device", action="store_true", help=None if worker else
                   "sweep although this GPU is not the one the deployment's device profile names (device_name): "
                   "the export would carry this GPU's timings under that deployment's name")
    p.add_argument("--grace", type=positive_int("--grace"), default=60,
                   help="seconds without a heartbeat before a running trial is failed and retried (default 60)")


def options_from_args(args) -> SweepOptions:
    """SweepOptions from the flags of `add_sweep_arguments` (and the sweep's own, when present)."""
    return SweepOptions(tps=args.tp, ctxs=args.ctx, bss=args.bs, backends=args.backend, trials=args.trials,
                        storage=args.storage, timing=args.timing, seed=args.seed, device=args.device, out=args.out,
                        space_dir=args.space_dir, remeasure_top=getattr(args, "remeasure_top", 3),
                        rounds=getattr(args, "rounds", 3), isolate=not getattr(args, "in_process", False),
                        trial_timeout_s=args.trial_timeout,
                        progress=not (args.no_progress or getattr(args, "quiet", 0)),
                        max_minutes=args.max_minutes, max_measurements=args.max_measurements,
                        compile_workers=args.compile_workers, grid=args.grid,
                        retune_stale=getattr(args, "retune_stale", False), other_device=args.other_device)
