"""`kvtune sweep DEPLOYMENT.yaml`: one Optuna study per (deployment, backend, tp, bs, ctx).

Per study: the backend's default config is trial 0 (the baseline); the neighbouring
buckets' best configs are enqueued as warm starts; a space no larger than the trial budget
is swept as a grid, a larger one with TPE and steps to the best config's neighbours
(`tuner/strategy.py`). A config breaking a search-space constraint is
pruned without touching the device; everything else goes to the measurement helper
(`tuner.measure`) in a worker process. Studies live in Optuna's RDB storage (SQLite under
`results/<deployment>/` by default, created with load_if_exists): re-running resumes, and
finished trials are never repeated. Every finished trial is told to its study and appended
to `results/<deployment>/trials.csv` at once, so Ctrl-C loses nothing finished.

After the studies of one (backend, tp, bs): compile-time configs that won some context
bucket are measured at the other buckets too (so that export can pick one config for all
buckets under one CUDA graph), then the top configs of each bucket are re-measured,
interleaved with the baseline, before any winner is declared. Last, per (tp, bs), the
config export would pick is checked the way serving runs it (params.NSPLIT = the largest
bucket NSPLIT, a SplitTable picking each bucket's NSPLIT on the device); one that fails is
recorded and the next best is checked.

Compiling overlaps measuring: TPE is asked for several configs at once (constant liar;
min(max(1, compile workers), max(2, ceil(budget / 6))), `SearchStrategy.width`), a pool of
processes compiles them into the backends' on-disk caches, and the worker measures them in
order. Trials table columns: `tuner/table.py`; measurement: `tuner/measure.py`.

`--workers N` runs the search in N worker processes (one per visible GPU) sharing the
studies through a journal file or PostgreSQL, with heartbeats; the phases after the search
then run once, here. See `tuner/workers.py` (and `kvtune worker` to join from other hosts).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time
import warnings
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .config import ConfigError, Deployment, load_deployment, redact_argv, redact_url
from .space import SearchSpace, load_space, problem_env
from .strategy import DEFAULT as DEFAULT_STRATEGY
from .strategy import SearchStrategy, local_proposal, params_key
from .table import TrialsTable, append_jsonl
from .worker import Prefetcher, WorkerError, make_executor

STUDY_SEP = "|"


def study_name(dep: str, backend: str, tp: int, bs: int, ctx: int) -> str:
    return STUDY_SEP.join((dep, backend, f"tp{tp}", f"bs{bs}", f"ctx{ctx}"))


def compile_key(params: dict) -> str:
    """The compile-time part of a config: everything but NSPLIT (free per context bucket)."""
    return params_key({k: v for k, v in params.items() if k != "NSPLIT"})


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


class _Stop(Exception):
    """The measurement limit of this run was reached (a planned interruption)."""


@dataclass
class StudyResult:
    backend: str
    tp: int
    bs: int
    ctx: int
    name: str
    counts: dict
    default_us: float | None = None
    best_us: float | None = None
    best_params: dict | None = None
    floor_us: float | None = None
    note: str = ""


class Sweep:
    def __init__(self, dep: Deployment, opts: SweepOptions):
        try:
            import optuna
        except ImportError as e:
            raise ConfigError(f"kvtune sweep needs optuna ({e}); install the tuner extra: "
                              "pip install 'kvtune[tune]'") from None
        self.optuna = optuna
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        self.dep = dep
        self.o = opts
        self.device = opts.device or _default_device()
        if self.device == "cuda" and _default_device() != "cuda":
            raise ConfigError("--device cuda: no CUDA GPU is visible here; use --device cpu (Triton interpreter)")
        check_options(opts, dep)
        self.out_dir = Path(opts.out) / dep.name
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.storage_url = opts.storage or self._default_storage()
        self.tps = _subset(opts.tps, dep.tp, "--tp", dep.source)
        self.ctxs = _subset(opts.ctxs, dep.contexts, "--ctx", dep.source)
        self.bss = _subset(opts.bss, dep.batches, "--bs", dep.source)
        self.backends = _subset(opts.backends, dep.backends, "--backend", dep.source, allow_extra=True)
        self.trials = opts.trials or dep.trials
        timing = opts.timing or dep.timing
        self.timing = "cpu-eager" if self.device == "cpu" else timing
        self.measured_now = 0
        self.skipped: dict[str, str] = {}
        self.results: list[StudyResult] = []
        self.executor = make_executor(self.device, opts.isolate, opts.trial_timeout_s)
        cw = opts.compile_workers
        if cw is None:  # compiling is only worth a pool on the GPU (the interpreter compiles nothing)
            cw = 0 if self.device == "cpu" else max(1, min(6, (os.cpu_count() or 2) // 2 - 1))
        self.prefetch = Prefetcher(self.device, cw)
        self.storage, self.storage_url = self._open_storage()
        self.bar = None

    shared = False   # several processes share the studies and the trials table (tuner/workers.py)

    def _default_storage(self) -> str:
        return f"sqlite:///{self.out_dir / 'studies.db'}"

    def _open_storage(self):
        return open_storage(self.storage_url, self.out_dir)

    # -- set-up ---------------------------------------------------------------------------
    def _setup(self):
        self.info = self.executor.request({"op": "info", "device": self.device})
        self.prefetch.arch = self.info["arch"] if self.device == "cuda" else None
        prof = self.dep.device
        if self.device == "cuda" and prof.arch != self.info["arch"]:
            print(f"warning: deployment device profile {prof.name} is {prof.arch}, this GPU is "
                  f"{self.info['arch']} ({self.info['device_name']}); floors use the profile's ceilings",
                  file=sys.stderr)
        if self.device == "cpu":
            print("note: --device cpu: Triton runs under its interpreter; timings are CPU timings "
                  "('cpu-eager'), not GPU numbers", file=sys.stderr)
            if prof.arch != "cpu":
                print(f"warning: deployment {self.dep.name} ({self.dep.source}) is sized for {prof.device_name} "
                      f"({prof.arch}): {max(self.ctxs)}-token contexts at {self.dep.heads(min(self.tps))} heads "
                      "under the CPU interpreter take minutes per trial; on a machine without a GPU sweep a "
                      "CPU deployment such as configs/deployments/cpu-tiny.yaml", file=sys.stderr)
        self.binfo, self.spaces = {}, {}
        for be in self.backends:
            bi = self.executor.request({"op": "backend", "backend": be, "spec": None, "device": self.device})
            if bi.get("unsupported"):
                self.skipped[be] = bi["unsupported"]
                print(f"skipping backend {be}: {bi['unsupported']}", file=sys.stderr)
                continue
            self.binfo[be] = bi
            self.spaces[be] = load_space(be, bi["fields"], self.o.space_dir or self.dep.space_dir)
        names = []
        for bi in self.binfo.values():
            names += [f for f in bi["fields"] if f not in names]
        self.table = TrialsTable(self.out_dir / "trials.csv", names, shared=self.shared)

    def _spec(self, tp, bs, ctx):
        from .measure import ProblemSpec
        m = self.dep.model
        return ProblemSpec(heads=self.dep.heads(tp), batch=bs, context=ctx, draft_tokens=m.draft_tokens,
                           tree=self.dep.tree, kv_lora_rank=m.kv_lora_rank, rope_dim=m.qk_rope_head_dim,
                           sm_scale=m.scale)

    def _options(self, seed):
        opts = {"timing": self.timing, "workspace_budget_bytes": self.dep.workspace_budget_bytes, "seed": seed}
        if self.device == "cpu":
            opts.update(warmup=0, cpu_reps=3)
        opts.update(self.o.measure_overrides)
        return opts

    # -- one measurement ------------------------------------------------------------------
    def _measure(self, backend, params, spec, seed, extra: dict | None = None) -> dict:
        if self.o.max_measurements is not None and self.measured_now >= self.o.max_measurements:
            raise _Stop("measurement limit")
        if self.o.max_minutes is not None and time.time() - self.t0 > 60 * self.o.max_minutes:
            raise _Stop(f"time limit of {self.o.max_minutes:g} min")
        prof = self.dep.device
        req = {"op": "measure", "device": self.device, "backend": backend, "params": params, "spec": asdict(spec),
               "options": {**self._options(seed), **(extra or {})},
               "arch": self.info["arch"] if self.device == "cuda" else None,
               "l2_bytes": self.info.get("l2_bytes") or prof.l2_bytes if self.device == "cuda" else None,
               "ceilings": {"read_gbps": prof.read_gbps, "bf16_tflops": prof.bf16_tflops}}
        self.measured_now += 1
        try:
            return self.executor.request(req)
        except WorkerError as e:
            from .measure import Ceilings
            return {"outcome": "failed", "reason": str(e), "timing": self.timing,
                    "floor_us": Ceilings(prof.read_gbps, prof.bf16_tflops).floor_us(spec)}

    def _row(self, backend, tp, bs, ctx, spec, name, trial, role, params, m, phase="search", rnd=""):
        i = self.info
        row = {"deployment": self.dep.name, "study": name, "phase": phase, "round": rnd, "backend": backend,
               "tp": tp, "heads": spec.heads, "bs": bs, "ctx": ctx, "T": spec.draft_tokens, "tree": spec.tree,
               "trial": trial, "role": role, "params": params}
        for k in ("outcome", "reason", "median_us", "p10_us", "p90_us", "rel_err", "gbps", "tflops", "floor_us",
                  "pct_floor", "timing", "launches", "pools", "wall_s"):
            v = m.get(k)
            # significant digits, not decimals: CPU-interpreter GB/s and small errors are << 1e-4
            row[k] = float(f"{v:.6g}") if isinstance(v, float) else v
        row.update(device=i["device_name"], arch=i["arch"], sm_count=i["sm_count"], driver=i["driver"],
                   cuda=i["cuda"], nvrtc=i["nvrtc"], torch=i["torch"], triton=i["triton"],
                   kernel_hash=self.binfo[backend].get("kernel_hash", ""), kvtune=i["kvtune"],
                   date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        return row

    # -- one study ------------------------------------------------------------------------
    def _finished(self, study):
        TS = self.optuna.trial.TrialState
        return [t for t in study.get_trials(deepcopy=False, states=(TS.COMPLETE, TS.PRUNED, TS.FAIL))
                if "outcome" in t.user_attrs and "duplicate_of" not in t.user_attrs]

    def _open_study(self, backend, tp, bs, ctx):
        name = study_name(self.dep.name, backend, tp, bs, ctx)
        seed = self.o.seed + int(hashlib.sha256(name.encode()).hexdigest()[:6], 16)
        sampler = self.o.strategy.sampler(self.optuna, seed, self.trials)
        study = self.optuna.create_study(study_name=name, storage=self.storage, sampler=sampler,
                                         direction="minimize", load_if_exists=True)
        self._reclaim(study)
        return name, study, seed

    def _reclaim(self, study):
        """Trials left running by an interrupted single-worker sweep: failed, not counted.
        (Several workers sharing the storage must not do this: they rely on heartbeats.)"""
        if not self.o.reclaim_running:
            return
        TS = self.optuna.trial.TrialState
        for t in study.get_trials(deepcopy=False, states=(TS.RUNNING,)):
            study._storage.set_trial_user_attr(t._trial_id, "interrupted", True)
            study.tell(t.number, state=TS.FAIL)

    def _reconcile(self, study, name):
        """Rows of finished trials the table lacks (killed between tell and append)."""
        for t in study.get_trials(deepcopy=False):
            row = t.user_attrs.get("row")
            if row and not self.table.has(row):
                self.table.append(row)

    def _tell(self, study, trial, m: dict, row: dict):
        TS = self.optuna.trial.TrialState
        for k in ("outcome", "reason", "median_us", "pct_floor"):
            trial.set_user_attr(k, m.get(k))
        trial.set_user_attr("row", row)
        if m["outcome"] == "ok":
            study.tell(trial, m["median_us"])
        else:
            study.tell(trial, state=TS.PRUNED if m["outcome"] == "pruned" else TS.FAIL)
        self.table.append(row)

    def _study_space(self, backend, tp, bs, ctx):
        """What a study searches: (space, spec, default params, distributions, constraint env,
        feasible configs or None, the grid to sweep whole or None)."""
        space: SearchSpace = self.spaces[backend]
        spec = self._spec(tp, bs, ctx)
        default = self.executor.request({"op": "backend", "backend": backend, "spec": asdict(spec),
                                         "device": self.device})["default"]
        dists = space.distributions(extra=default)
        env = problem_env(spec.draft_tokens, spec.heads, bs, ctx, spec.Dk, spec.kv_lora_rank, self.dep.device)
        # a space no larger than the budget is swept whole (its infeasible points recorded as
        # pruned); else, if its feasible part fits the budget, that part; else TPE
        full = [dict(zip(dists, vals)) for vals in _product(list(dists.values()))] \
            if _size(dists) <= max(self.trials, 50000) else None
        feasible = [g for g in full if not space.violation(g, env)] if full is not None else None
        grid = full if full is not None and len(full) <= self.trials else \
            feasible if feasible is not None and (len(feasible) <= self.trials or self.o.grid) else None
        return space, spec, default, dists, env, feasible, grid

    def _check_dists(self, study, name, space, backend, dists, spec):
        stored = study.user_attrs.get("dists")
        if stored is None:
            study.set_user_attr("dists", {n: list(v) for n, v in dists.items()})
            study.set_user_attr("spec", asdict(spec))
        elif {n: tuple(v) for n, v in stored.items()} != dists:
            raise ConfigError(f"{space.source}: the search space of {backend} changed since study {name!r} was "
                              f"created in {redact_url(self.storage_url)}; sweep into a new --storage/--out, "
                              "or delete it")

    def run_study(self, backend, tp, bs, ctx, warm: list[dict]) -> StudyResult:
        TS = self.optuna.trial.TrialState
        space, spec, default, dists, env, feasible, grid = self._study_space(backend, tp, bs, ctx)
        name, study, seed = self._open_study(backend, tp, bs, ctx)
        self._check_dists(study, name, space, backend, dists, spec)
        self._reconcile(study, name)
        measured = {params_key(t.params): t for t in self._finished(study)}
        strategy = self.o.strategy
        counted = sum(1 for t in measured.values() if strategy.counts(t.user_attrs))
        rng = random.Random(seed)
        waiting = {params_key(t.params) for t in study.get_trials(deepcopy=False, states=(TS.WAITING,))}

        def enqueue(params, role):
            k = params_key(params)
            if k in measured or k in waiting:
                return
            if any(params.get(n) not in dists[n] for n in dists):
                return
            study.enqueue_trial(params, user_attrs={"role": role})
            waiting.add(k)

        enqueue(default, "baseline")
        for w in warm:
            enqueue(w, "warm")
        if grid is not None:
            for g in grid:
                enqueue(g, "search")
        cap = max(4 * self.trials, self.trials + 20) + (len(grid) if grid else 0)
        asks = 0
        note = ""
        sd = asdict(spec)
        while True:
            # -- how many configs are still owed; ask that many (at most one per compile worker)
            if grid is not None:
                owed = sum(1 for g in grid if params_key(g) not in measured)
            else:
                owed = max(self.trials - counted, 0 if params_key(default) in measured else 1)
            if owed <= 0:
                break
            if asks >= cap:
                note = "search space exhausted (the sampler kept proposing measured configs)"
                break
            batch = []
            # one config per compile worker, at most max(2, ceil(trials / strategy.rounds)) at once
            width = strategy.width(self.prefetch.workers, self.trials)
            for _ in range(min(owed, width, cap - asks)):
                if grid is None:
                    self._steer(study, strategy, counted + len(batch), measured, batch, dists,
                                lambda q: not space.violation(q, env), rng)
                trial = study.ask()
                asks += 1
                params = {n: trial.suggest_categorical(n, dists[n]) for n in dists}
                role = trial.user_attrs.get("role", "search")
                trial.set_user_attr("role", role)
                batch.append((trial, params, role))
                if params_key(params) not in measured and not self._violation(role, space, params, env):
                    self.prefetch.submit(backend, params, sd)   # compile ahead while earlier ones measure
            # -- measure the batch in order
            def repair():
                """After a wasted proposal (measured already, or infeasible) a random feasible
                config not measured yet is asked next, so a small space cannot stall TPE."""
                if grid is None and feasible:
                    todo = [g for g in feasible if params_key(g) not in measured and params_key(g) not in waiting]
                    if todo:
                        enqueue(rng.choice(todo), "search")

            for i, (trial, params, role) in enumerate(batch):
                k = params_key(params)
                if k in measured:
                    repair()
                    src = measured[k]
                    trial.set_user_attr("duplicate_of", src.number)
                    if src.state == TS.COMPLETE:
                        study.tell(trial, src.value)
                    else:
                        study.tell(trial, state=src.state)
                    continue
                waiting.discard(k)
                try:
                    m, why = self._run_one(backend, trial, params, role, space, env, spec, sd, seed, repair)
                except BaseException:
                    for t, _, _ in batch[i:]:  # not finished: failed as interrupted, not counted
                        study._storage.set_trial_user_attr(t._trial_id, "interrupted", True)
                        study.tell(t, state=TS.FAIL)
                    raise
                row = self._row(backend, tp, bs, ctx, spec, name, trial.number, role, params, m)
                self._tell(study, trial, m, row)
                measured[k] = study._storage.get_trial(trial._trial_id)
                if not why:
                    counted += strategy.counts(measured[k].user_attrs)
                    self._progress(m)
        return self._study_result(backend, tp, bs, ctx, name, study, note)

    @staticmethod
    def _violation(role, space, params, env):
        """The search-space constraint `params` break, or None; the baseline and cross-bucket
        configs are measured whatever the constraints say."""
        return None if role in ("baseline", "cross") else space.violation(params, env)

    def _run_one(self, backend, trial, params, role, space, env, spec, sd, seed, repair, guard=nullcontext):
        """One batch member's outcome and the constraint that pruned it (or None): pruned
        without GPU time, else measured once its ahead-of-time compile is done (inside
        `guard`). Shared by the single-process sweep and the workers."""
        why = self._violation(role, space, params, env)
        if why:
            trial.set_user_attr("constraint", True)
            repair()
            return {"outcome": "pruned", "reason": why, "timing": self.timing}, why
        with guard():
            self.prefetch.wait(backend, params, sd)
            return self._measure(backend, params, spec, seed + trial.number), None

    def _steer(self, study, strategy, n_search, measured, batch, dists, feasible, rng, busy=()):
        """Queue the next config when the strategy picks it rather than TPE (a neighbour of the
        best so far), unless configs are queued already."""
        TS = self.optuna.trial.TrialState
        if not strategy.is_local(n_search, self.trials):
            return
        queued = study.get_trials(deepcopy=False, states=(TS.WAITING,))
        if queued:
            return
        ranked = [dict(t.params) for t in sorted((t for t in measured.values() if t.state == TS.COMPLETE),
                                                 key=lambda t: t.value)]
        taken = set(measured) | set(busy) | {params_key(p) for _, p, _ in batch}
        q = local_proposal(ranked, dists, taken, feasible, rng)
        if q is not None:
            study.enqueue_trial(q, user_attrs={"role": "search", "via": "local"})

    def _study_result(self, backend, tp, bs, ctx, name, study, note=""):
        fin = self._finished(study)
        counts = {o: 0 for o in ("ok", "pruned", "wrong", "failed")}
        best, base, floor = None, None, None
        for t in fin:
            counts[t.user_attrs["outcome"]] = counts.get(t.user_attrs["outcome"], 0) + 1
            row = t.user_attrs.get("row") or {}
            floor = row.get("floor_us") or floor
            if t.user_attrs["outcome"] == "ok":
                if best is None or t.value < best.value:
                    best = t
                if t.user_attrs.get("role") == "baseline":
                    base = t
        return StudyResult(backend, tp, bs, ctx, name, counts, default_us=base.value if base else None,
                           best_us=best.value if best else None, best_params=dict(best.params) if best else None,
                           floor_us=floor, note=note)

    # -- after the studies of one (backend, tp, bs) ---------------------------------------
    def _ok_trials(self, study):
        return sorted((t for t in self._finished(study) if t.user_attrs["outcome"] == "ok"), key=lambda t: t.value)

    def cross_measure(self, backend, tp, bs):
        """Measure the compile-time configs that won some bucket at every other bucket."""
        TS = self.optuna.trial.TrialState
        studies = {ctx: self._open_study(backend, tp, bs, ctx) for ctx in self.ctxs}
        oks = {ctx: self._ok_trials(s[1]) for ctx, s in studies.items()}
        cands: dict[str, dict] = {}
        for ctx in self.ctxs:
            for t in oks[ctx][:2]:
                cands.setdefault(compile_key(t.params), dict(t.params))
            for t in oks[ctx]:
                if t.user_attrs.get("role") == "baseline":
                    cands.setdefault(compile_key(t.params), dict(t.params))
        space = self.spaces[backend]
        plan = []
        for ctx in self.ctxs:
            name, study, seed = studies[ctx]
            have = {compile_key(t.params) for t in oks[ctx]}
            tried = {params_key(t.params) for t in self._finished(study)}
            spec = self._spec(tp, bs, ctx)
            env = problem_env(spec.draft_tokens, spec.heads, bs, ctx, spec.Dk, spec.kv_lora_rank, self.dep.device)
            dists = {n: tuple(v) for n, v in study.user_attrs["dists"].items()}
            nsplits = [oks[ctx][0].params["NSPLIT"]] if oks[ctx] and "NSPLIT" in space.names else []
            for ck, p in cands.items():
                if ck in have or any(p.get(n) not in dists[n] for n in dists if n != "NSPLIT"):
                    continue
                options = [dict(p, NSPLIT=n) for n in dict.fromkeys(nsplits + [p.get("NSPLIT")]) if n is not None] \
                    if "NSPLIT" in space.names else [p]
                options = [q for q in options if params_key(q) not in tried and q.get("NSPLIT", 1) in
                           dists.get("NSPLIT", (1,)) and not space.violation(q, env)]
                if options:
                    plan.append((ctx, options))
                    self.prefetch.submit(backend, options[0], asdict(spec))
        for ctx, options in plan:
            name, study, seed = studies[ctx]
            spec = self._spec(tp, bs, ctx)
            dists = {n: tuple(v) for n, v in study.user_attrs["dists"].items()}
            for q in options:
                trial, params = self._ask_for(study, q, dists, "cross")
                try:
                    self.prefetch.wait(backend, params, asdict(spec))
                    m = self._measure(backend, params, spec, seed + trial.number)
                except BaseException:
                    study._storage.set_trial_user_attr(trial._trial_id, "interrupted", True)
                    study.tell(trial, state=TS.FAIL)
                    raise
                self._tell(study, trial, m,
                           self._row(backend, tp, bs, ctx, spec, name, trial.number, "cross", params, m))
                self._progress(m, count=False)
                if m["outcome"] == "ok":
                    break

    def _ask_for(self, study, q: dict, dists: dict, role: str):
        """A new trial of `study` with exactly the params `q` (configs left queued by an
        earlier, interrupted run are released unmeasured on the way)."""
        TS = self.optuna.trial.TrialState
        study.enqueue_trial(q, user_attrs={"role": role})
        while True:
            trial = study.ask()
            params = {n: trial.suggest_categorical(n, dists[n]) for n in dists}
            if params_key(params) == params_key(q):
                return trial, params
            trial.set_user_attr("released", True)
            study.tell(trial, state=TS.FAIL)

    def remeasure(self, backend, tp, bs):
        """Re-measure each bucket's top configs interleaved with the baseline (and the
        per-bucket configs of the best cross-bucket candidates) before declaring winners."""
        if self.o.remeasure_top <= 0 or self.o.rounds <= 0:
            return
        studies = {ctx: self._open_study(backend, tp, bs, ctx) for ctx in self.ctxs}
        oks = {ctx: self._ok_trials(s[1]) for ctx, s in studies.items()}
        # compile-time keys by total over the buckets (best NSPLIT per bucket)
        per = {}
        for ctx, ts in oks.items():
            for t in ts:
                per.setdefault(compile_key(t.params), {}).setdefault(ctx, t)
        full = sorted((sum(v[c].value for c in self.ctxs), ck) for ck, v in per.items() if len(v) == len(self.ctxs))
        top_keys = [ck for _, ck in full[:2]]
        for ctx in self.ctxs:
            name, study, seed = studies[ctx]
            chosen = []
            for t in oks[ctx][: self.o.remeasure_top]:
                chosen.append(t)
            for ck in top_keys:
                chosen.append(per[ck][ctx])
            chosen += [t for t in oks[ctx] if t.user_attrs.get("role") == "baseline"]
            uniq = list({t.number: t for t in chosen}.values())
            sig = ",".join(str(t.number) for t in sorted(uniq, key=lambda t: t.number))
            if study.user_attrs.get("remeasured") == sig or len(uniq) < 2:
                continue
            spec = self._spec(tp, bs, ctx)
            for r in range(self.o.rounds):
                order = uniq[r % len(uniq):] + uniq[: r % len(uniq)]
                for t in order:
                    row_probe = {"study": name, "phase": "remeasure", "trial": t.number, "round": r}
                    if self.table.has(row_probe):
                        continue
                    m = self._measure(backend, dict(t.params), spec, seed + 100003 * (r + 1) + t.number)
                    self.table.append(self._row(backend, tp, bs, ctx, spec, name, t.number,
                                                t.user_attrs.get("role", "search"), dict(t.params), m,
                                                phase="remeasure", rnd=r))
                    self._progress(m, remeasure=True)
            study.set_user_attr("remeasured", sig)

    def serve_check(self, tp, bs):
        """Check the config export would pick for (tp, bs) the way serving runs it: params.NSPLIT
        = the largest bucket NSPLIT and a SplitTable choosing each bucket's NSPLIT on the
        device, at every context bucket (correctness gate and timing). A config that fails
        is recorded (phase `serve`) and the next best is checked; export skips failed ones."""
        from kvtune.kernels.tuned import BACKEND_NAMES

        from .export import choose, serve_key, served
        from .table import read_trials
        backends = [b for b in self.spaces if b in BACKEND_NAMES]
        T = self.dep.model.draft_tokens
        exclude: set = set()
        for _ in range(5):
            df = read_trials(self.table.path)
            df = df[(df["deployment"] == self.dep.name) & (df["device"].astype(str) == str(self.info["device_name"]))]
            contexts = sorted(int(c) for c in set(df[(df["tp"] == tp) & (df["bs"] == bs) &
                                                     (df["phase"] == "search")]["ctx"]))
            pick, _ = choose(df, backends, tp, bs, contexts, frozenset(exclude)) if contexts else (None, [])
            if pick is None:
                return
            be, cparams, buckets, _ = pick
            params, table = served(cparams, buckets, contexts, T, be, bs)
            key = serve_key(be, params, table)
            ok = True
            for ctx in contexts:
                name = study_name(self.dep.name, be, tp, bs, ctx)
                prev = df[(df["study"] == name) & (df["phase"] == "serve") & (df["round"].astype(str) == key)]
                if len(prev):
                    ok = ok and bool((prev["outcome"] == "ok").all())
                    continue
                spec = self._spec(tp, bs, ctx)
                m = self._measure(be, params, spec, self.o.seed + 7 * ctx, extra={"split_table": table})
                self.table.append(self._row(be, tp, bs, ctx, spec, name, 0, "export", params, m, phase="serve",
                                            rnd=key))
                self._progress(m, count=False)
                ok = ok and m["outcome"] == "ok"
            if ok:
                return
            exclude.add((be, json.dumps(cparams, sort_keys=True)))

    # -- progress and the whole sweep -----------------------------------------------------
    def _progress(self, m, remeasure=False, count=True):
        if self.bar is None:
            return
        self.bar.update(1 if count and not remeasure else 0)
        if m.get("outcome") == "ok" and not remeasure:
            if self._best is None or m["median_us"] < self._best[0]:
                self._best = (m["median_us"], m.get("pct_floor"))
        if self._best:
            pf = f"{self._best[1]:.1f}%" if self._best[1] is not None else "?"
            self.bar.set_postfix_str(f"{self._study}: best {self._best[0]:.1f} us ({pf} of floor)")

    def run(self) -> list[StudyResult]:
        t0 = self.t0 = time.time()
        self._setup()
        plan = [(be, tp, bs, ctx) for be in self.backends if be in self.spaces
                for tp in self.tps for bs in self.bss for ctx in self.ctxs]
        if self.o.progress:
            try:
                from tqdm import tqdm
            except ImportError:  # a machine without tqdm: one line per study instead
                tqdm = _LineProgress
            if not sys.stderr.isatty():   # a log file: a bar's redraws would make one huge line
                tqdm = _LineProgress
            self.bar = tqdm(total=len(plan) * self.trials, unit="trial", dynamic_ncols=True, file=sys.stderr)
        self._best = None
        status = "complete" if plan else "nothing to sweep (every backend was skipped)"
        try:
            best_of: dict = {}
            for tp in self.tps:
                for bs in self.bss:
                    for be in [b for b in self.backends if b in self.spaces]:
                        for i, ctx in enumerate(self.ctxs):
                            self._study = f"{be} tp{tp} bs{bs} ctx{ctx}"
                            self._best = None
                            warm = []
                            if i > 0 and best_of.get((be, tp, bs, self.ctxs[i - 1])):
                                prev = best_of[(be, tp, bs, self.ctxs[i - 1])]
                                warm.append(prev)
                                if "NSPLIT" in prev:
                                    warm.append(dict(prev, NSPLIT=_nearest(self.spaces[be].choices["NSPLIT"],
                                                     prev["NSPLIT"] * ctx / self.ctxs[i - 1])))
                            j = self.tps.index(tp)
                            if j > 0 and best_of.get((be, self.tps[j - 1], bs, ctx)):
                                warm.append(best_of[(be, self.tps[j - 1], bs, ctx)])
                            res = self.run_study(be, tp, bs, ctx, warm)
                            self.results.append(res)
                            best_of[(be, tp, bs, ctx)] = res.best_params
                        self._study = f"{be} tp{tp} bs{bs} cross/remeasure"
                        self.cross_measure(be, tp, bs)
                        self.remeasure(be, tp, bs)
                    self._study = f"tp{tp} bs{bs} serving check"
                    self.serve_check(tp, bs)
        except (KeyboardInterrupt, _Stop) as e:
            status = "interrupted" if isinstance(e, KeyboardInterrupt) else f"stopped ({e})"
            print(f"\nsweep {status}: every finished trial is saved; re-run the same command to resume",
                  file=sys.stderr)
        finally:
            if self.bar is not None:
                self.bar.close()
            self.executor.close(force=status != "complete")
            self.prefetch.close()
        self.status = status
        self.wall_s = time.time() - t0
        self._log_run(t0)
        return self.results

    def _log_run(self, t0):
        append_jsonl(self.out_dir / "runs.jsonl", self._run_record(t0))

    def _run_record(self, t0) -> dict:
        return {"command": " ".join(redact_argv(sys.argv)), "deployment": self.dep.name, "device": self.device,
               "status": self.status, "start": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
               "wall_s": round(self.wall_s, 1), "measurements": self.measured_now, "skipped": self.skipped,
               "studies": len(self.results), "storage": redact_url(self.storage_url),
               "restarts": getattr(self.executor, "restarts", 0),
               "provenance": {k: v for k, v in getattr(self, "info", {}).items()}}

    def summary(self) -> str:
        import pandas as pd
        if not self.results:
            return "(no studies ran)"
        rows = []
        for r in self.results:
            rows.append({"backend": r.backend, "tp": r.tp, "bs": r.bs, "ctx": r.ctx,
                         "ok/pruned/wrong/failed": "/".join(str(r.counts.get(k, 0))
                                                            for k in ("ok", "pruned", "wrong", "failed")),
                         "default_us": r.default_us, "best_us": r.best_us,
                         "speedup": (r.default_us / r.best_us) if r.default_us and r.best_us else None,
                         "floor_us": r.floor_us,
                         "pct_floor": (100 * r.floor_us / r.best_us) if r.floor_us and r.best_us else None,
                         "note": r.note})
        df = pd.DataFrame(rows)
        lines = [f"sweep of {self.dep.name} on {self.info.get('device_name')} ({self.info.get('arch')}), "
                 f"timing {self.timing}, {self.wall_s:.1f} s, {self.measured_now} measurements, status {self.status}"]
        for be, why in self.skipped.items():
            lines.append(f"skipped backend {be}: {why}")
        lines.append(df.to_string(index=False, float_format=lambda x: f"{x:.2f}"))
        return "\n".join(lines)


# --------------------------------------------------------------------------- helpers
class _LineProgress:
    """tqdm's surface for a log file or a machine without tqdm: one line per study, written
    when the next study reports (or at the end), with the trial count and that study's best."""

    def __init__(self, total, file=sys.stderr, **_):
        self.n, self.total, self.file, self.last = 0, total, file, None

    def update(self, k=1):
        self.n += k

    def set_postfix_str(self, s):
        if self.last is not None and s.split(":")[0] != self.last.split(":")[0]:
            self._line()
        self.last, self.last_n = s, self.n

    def _line(self):
        print(f"[{self.last_n}/{self.total} trials] {self.last}", file=self.file, flush=True)

    def close(self):
        if self.last is not None:
            self._line()
            self.last = None



def _product(lists):
    import itertools
    return list(itertools.product(*lists))


def _size(dists) -> int:
    n = 1
    for v in dists.values():
        n *= len(v)
    return n


def _nearest(choices, x):
    return min(choices, key=lambda c: (abs(c - x), c))


def _positive_int(flag):
    def parse(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag}: expected a positive integer, got {text!r}") from None
        if v < 1:
            raise argparse.ArgumentTypeError(f"{flag}: expected a positive integer, got {v}")
        return v
    return parse


def _non_negative(flag):
    def parse(text):
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag}: expected a number of minutes, got {text!r}") from None
        if not v >= 0 or v == float("inf"):
            raise argparse.ArgumentTypeError(f"{flag}: expected a finite number of minutes >= 0, got {text}")
        return v
    return parse


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


def _subset(sel, allowed, flag, src, allow_extra=False):
    if not sel:
        return list(allowed)
    bad = [v for v in sel if v not in allowed]
    if bad and not allow_extra:
        raise ConfigError(f"{flag}: {bad} not in the deployment's values {list(allowed)} ({src})")
    return list(dict.fromkeys(sel))


def _default_device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def open_storage(url: str, out_dir: Path):
    """Optuna storage from a URL: any SQLAlchemy URL (SQLite by default, PostgreSQL for
    several hosts), or `journal:PATH` for Optuna's journal file. Without SQLAlchemy the
    default SQLite file falls back to a journal file next to it (said on stderr)."""
    import optuna
    if url.startswith("journal:"):
        path = url[len("journal:"):]
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        return optuna.storages.JournalStorage(journal_backend(path)), url
    try:
        import sqlalchemy  # noqa: F401
    except ImportError:
        path = out_dir / "studies.journal"
        print(f"note: SQLAlchemy is not installed; studies go to the journal file {path} instead of {redact_url(url)}",
              file=sys.stderr)
        return open_storage(f"journal:{path}", out_dir)
    return optuna.storages.RDBStorage(url, engine_kwargs=_engine_kwargs(url)), url


def journal_backend(path):
    """Optuna's journal file backend: JournalFileBackend (optuna >= 4), JournalFileStorage before."""
    try:
        from optuna.storages.journal import JournalFileBackend
    except ImportError:  # optuna 3
        from optuna.storages import JournalFileStorage as JournalFileBackend
    return JournalFileBackend(str(path))


def _engine_kwargs(url: str) -> dict:
    if url.startswith("sqlite"):
        return {"connect_args": {"timeout": 60}}
    return {}


def run_sweep(deployment, opts: SweepOptions | None = None, **kw) -> Sweep:
    """Sweep a deployment (a path, a name, or a Deployment); returns the finished Sweep."""
    dep = deployment if isinstance(deployment, Deployment) else load_deployment(deployment)
    sw = Sweep(dep, opts or SweepOptions(**kw))
    sw.run()
    return sw


# --------------------------------------------------------------------------- CLI
def _cmd_sweep(args) -> int:
    if args.workers is not None:   # several worker processes sharing the studies (tuner/workers.py)
        from .workers import cmd_sweep_workers
        return cmd_sweep_workers(args)
    opts = SweepOptions(tps=args.tp, ctxs=args.ctx, bss=args.bs, backends=args.backend, trials=args.trials,
                        storage=args.storage, timing=args.timing, seed=args.seed, device=args.device, out=args.out,
                        space_dir=args.space_dir, remeasure_top=args.remeasure_top, rounds=args.rounds,
                        isolate=not args.in_process, trial_timeout_s=args.trial_timeout,
                        progress=not args.no_progress, max_minutes=args.max_minutes,
                        compile_workers=args.compile_workers, grid=args.grid)
    try:
        sw = run_sweep(args.deployment, opts)
    except WorkerError as e:
        print(f"kvtune sweep: error: the trial worker failed before the sweep started: {e}", file=sys.stderr)
        return 1
    print(sw.summary())
    print(f"trials: {sw.out_dir / 'trials.csv'}   studies: {redact_url(sw.storage_url)}")
    if not sw.results and sw.status != "interrupted":
        print(f"kvtune sweep: error: no study ran ({sw.status})", file=sys.stderr)
        return 1
    if args.export and sw.results:
        from .export import export_deployment
        export_deployment(sw.dep, out=args.out)
    return 130 if sw.status == "interrupted" else 0


def register(subparsers) -> None:
    p = subparsers.add_parser("sweep", help="tune a deployment: one Optuna study per (backend, tp, bs, ctx)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("deployment", help="deployment YAML (or its name under configs/deployments/)")
    p.add_argument("--tp", type=int, nargs="+", help="only these tp degrees")
    p.add_argument("--ctx", type=int, nargs="+", help="only these context buckets")
    p.add_argument("--bs", type=int, nargs="+", help="only these batch buckets")
    p.add_argument("--backend", nargs="+", help="only these backends")
    p.add_argument("--trials", type=_positive_int("--trials"),
                   help="trial budget per study (default: the deployment's)")
    p.add_argument("--storage", help="Optuna storage: an SQLAlchemy URL (default sqlite:///<out>/<deployment>/"
                   "studies.db) or journal:PATH; keep passwords out of it (PGPASSWORD or ~/.pgpass)")
    p.add_argument("--timing", choices=("graph", "eager"), help="CUDA timing mode (default: the deployment's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when a GPU is visible, else cpu")
    p.add_argument("--out", default="runs", help="output root (default ./runs; the committed evidence under "
                   "results/ is written only when named)")
    p.add_argument("--space-dir", help="search-space folder (default: the repository's search_spaces/)")
    p.add_argument("--remeasure-top", type=int, default=3, help="configs per bucket re-measured against the baseline")
    p.add_argument("--rounds", type=int, default=3, help="interleaved re-measurement rounds")
    p.add_argument("--trial-timeout", type=float, default=600.0, help="seconds before a trial's worker is killed")
    p.add_argument("--compile-workers", type=int,
                   help="processes compiling configs ahead of the measurement (default 0 on CPU, ~cores/2 on GPU)")
    p.add_argument("--grid", action="store_true",
                   help="measure every feasible config (exhaustive grid; to check TPE against, use another --out)")
    p.add_argument("--in-process", action="store_true", help="measure in this process (no fault isolation)")
    p.add_argument("--max-minutes", type=_non_negative("--max-minutes"),
                   help="stop (resumably, like Ctrl-C) after this much wall time")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--export", action="store_true", help="export the YAML when the sweep completes")
    p.add_argument("--workers", type=int,
                   help="run N worker processes (one per visible GPU; N CPU processes with --device cpu) that "
                        "share the studies through the storage (default journal:<out>/<deployment>/"
                        "studies.journal; a PostgreSQL URL lets `kvtune worker` join from other hosts)")
    from .workers import add_worker_options
    add_worker_options(p)
    p.set_defaults(func=_cmd_sweep)
