"""`kvtune sweep DEPLOYMENT.yaml`: one Optuna study per (deployment, backend, tp, bs, ctx).

Each study searches as `tuner/study.py` says (the baseline, warm starts, a grid or TPE with
steps to the best config's neighbours, constraint pruning, compiling ahead while measuring);
measurements come from `tuner/runner.py` (trials in a worker process replaced after a GPU
fault). Studies live in Optuna's RDB storage (SQLite under `<out>/<deployment>/` by
default, created with load_if_exists): re-running resumes, and finished trials are never
repeated. Every finished trial is told to its study and appended to
`<out>/<deployment>/trials.csv` at once, so Ctrl-C loses nothing finished.

After the studies of one (backend, tp, bs): compile-time configs that won some context
bucket are measured at the other buckets too (so that export can pick one config for all
buckets under one CUDA graph), then the top configs of each bucket are re-measured,
interleaved with the baseline, before any winner is declared. The sweep only measures:
which config is served, and its serving check, is the export's (`tuner/export.py`;
`kvtune sweep --export` runs it after the sweep). Trials table columns: `tuner/table.py`.

`--workers N` runs the search in N worker processes (one per visible GPU) sharing the
studies through a journal file or PostgreSQL, with heartbeats; the phases after the search
then run once, here. See `tuner/workers.py` (and `kvtune worker` to join from other hosts).
"""
from __future__ import annotations

import signal
import sys
import threading
import time
import warnings
from dataclasses import asdict
from pathlib import Path

from .config import ConfigError, Deployment, load_deployment, redact_argv, redact_url
from .extras import tune_module
from .log import get_logger
from .options import SweepOptions, check_options, subset
from .priors import FORGOTTEN, load_priors
from .progress import Progress
from .ragged import RAGGED_PICKS, deployment_trials, measure_ragged, ragged_applies, ragged_pick
from .runner import Runner
from .space import load_space, problem_env
from .strategy import params_key
from .studies_files import folder_storages, journal_url, sqlite_url
from .study import ALL_PRUNED, StudyLoop, compile_key, dead_buckets
from .runlock import RunLock, StorageLock
from .table import TrialsTable, append_jsonl, scan_table

log = get_logger(__name__)


class _StopSignals:
    """Ctrl-C (SIGINT) and SIGTERM (a scheduler's stop, `timeout`, `kill`) end the sweep as
    'interrupted', its studies closed, instead of killing it mid-trial.

    The handler raises KeyboardInterrupt where the signal lands; when it lands inside a
    garbage-collector callback (SQLAlchemy's weakref finalizers, under Optuna) Python prints
    "Exception ignored" and carries on, so the signal is also remembered and `check` raises
    it again before the next measurement and at the end of the work: a stop is never lost."""

    def __init__(self):
        self.signum = None
        self.previous = {}

    def install(self):
        if threading.current_thread() is not threading.main_thread():
            return           # signals can only be set in the main thread; the caller handles them there
        for s in (signal.SIGINT, signal.SIGTERM):
            self.previous[s] = signal.signal(s, self._handler)

    def restore(self):
        for s, h in self.previous.items():
            signal.signal(s, h)
        self.previous = {}

    def _handler(self, signum, frame):
        self.signum = signum
        raise KeyboardInterrupt

    def check(self):
        if self.signum is not None:
            raise KeyboardInterrupt


class SweepStopped(Exception):
    """The measurement or time limit of this run was reached (a planned interruption)."""


class Sweep(StudyLoop):
    """A sweep of one deployment in this process: set-up, the search of each study, the phases
    after it, the run record and the summary."""

    shared = False   # several processes share the studies and the trials table (tuner/workers.py)
    ragged = True    # the ragged phase runs (tuner/ragged.py; a replay of a grid table has no ragged batch)

    def __init__(self, dep: Deployment, opts: SweepOptions):
        # pandas too, before any measurement: the summary and the ragged phase read the table with it
        tune_module("pandas", "kvtune sweep")
        self.optuna = optuna = tune_module("optuna", "kvtune sweep")
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        self.dep = dep
        self.o = opts
        self.stops = _StopSignals()
        check_options(opts, dep)
        self.runner = Runner(dep, opts.device, opts.timing, opts.isolate, opts.trial_timeout_s,
                             opts.compile_workers, opts.measure_overrides)
        self.out_dir = Path(opts.out) / dep.name
        for p in (Path(opts.out), self.out_dir):
            if p.exists() and not p.is_dir():
                raise ConfigError(f"--out {opts.out}: {p} is a file, not a folder")
        self.tps = subset(opts.tps, dep.tp, "--tp", dep.source)
        self.ctxs = subset(opts.ctxs, dep.contexts, "--ctx", dep.source)
        self.bss = subset(opts.bss, dep.batches, "--bs", dep.source)
        self.backends = subset(opts.backends, dep.backends, "--backend", dep.source, allow_extra=True)
        try:   # after the selections: a refused one leaves no folder
            self.out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:   # a parent that is a file, a read-only or virtual file system
            raise ConfigError(f"--out {opts.out}: cannot make the folder {self.out_dir}: "
                              f"{e.strerror or e}") from None
        self.storage_url = opts.storage or self._default_storage()
        self.trials = opts.trials or dep.trials
        self.measured_now = 0
        self.results: list = []
        self.storage, self.storage_url = self._open_storage()
        self.bar = None
        self._best = None
        self._study = ""
        self._init_loop()

    # the measurement side, as the run record and tests name it
    device = property(lambda self: self.runner.device)
    timing = property(lambda self: self.runner.timing)
    executor = property(lambda self: self.runner.executor)
    info = property(lambda self: self.runner.info)
    skipped = property(lambda self: self.runner.skipped)

    def _default_storage(self) -> str:
        db, journal = folder_storages(self.out_dir)
        if journal.is_file() and not db.is_file():   # a `--workers` sweep's folder: resume its studies
            log.info("studies: %s (the storage of a --workers sweep of this folder)", journal)
            return journal_url(journal)
        return sqlite_url(db)

    def _open_storage(self):
        from .storage import open_storage
        return open_storage(self.storage_url)

    # -- set-up ---------------------------------------------------------------------------
    def _setup(self):
        binfo = self.runner.setup(self.backends)
        info, prof = self.runner.info, self.dep.device
        if self.device == "cuda":
            check_device_name(self.dep, info, self.o.other_device)
        if self.device == "cpu":
            log.info("note: --device cpu: Triton runs under its interpreter; timings are CPU timings "
                     "('cpu-eager'), not GPU numbers")
            if prof.arch != "cpu":
                log.warning("deployment %s (%s) is sized for %s (%s): %s-token contexts at %s heads under the CPU "
                            "interpreter take minutes per trial; on a machine without a GPU sweep a CPU deployment "
                            "such as configs/deployments/cpu-tiny.yaml", self.dep.name, self.dep.source,
                            prof.device_name, prof.arch, max(self.ctxs), self.dep.heads(min(self.tps)))
        self.spaces = {be: load_space(be, bi["fields"], self.o.space_dir or self.dep.space_dir)
                       for be, bi in binfo.items()}
        names = []
        for bi in binfo.values():
            names += [f for f in bi["fields"] if f not in names]
        self._stale_sources(binfo)   # before the table is loaded: forgetting rewrites it
        self.table = TrialsTable(self.out_dir / "trials.csv", names, shared=self.shared)
        self.priors = load_priors(self.out_dir / FORGOTTEN)
        if self.priors:
            log.info("%s: %d bucket winner(s) of set-aside trials, each measured first in its study (role prior)",
                     self.out_dir / FORGOTTEN, len(self.priors))

    def _stale_sources(self, binfo) -> None:
        """A backend whose trials here were measured on another kernel source: resuming would skip
        its finished studies, so the current source would never be tuned (and export counts only a
        backend's latest source). With --retune-stale its rows and studies are set aside
        (`kvtune forget`) and it is tuned from scratch; otherwise the sweep stops and says so. The
        same for every backend when the trials were measured for another model (heads, T, tree) than
        the deployment says now (its studies' names do not hold the model's shape)."""
        from .forget import forget_backend, model_changes, stale_sources
        table = self.out_dir / "trials.csv"
        rows = scan_table(table)[1] if table.is_file() else []
        changed = model_changes(rows, self.dep)
        dep = self.dep.source if Path(str(self.dep.source)).is_file() else self.dep.name
        if changed and self.o.retune_stale and not self.shared:
            bes = sorted({r["backend"] for r in rows if r.get("backend")})
            got = forget_backend(str(dep), bes, out=self.o.out, storage=self.storage_url)
            log.warning("trials of %s were measured for another model than %s says now (%s): %d row(s) moved to "
                        "trials.forgotten.csv with %d of their studies; tuning from scratch", self.dep.name,
                        self.dep.source, "; ".join(changed), got["rows"], got["studies"])
        elif changed:
            raise ConfigError(
                f"{table}: trials of {self.dep.name} were measured for another model than {self.dep.source} "
                f"says now ({'; '.join(changed)}); resuming would skip their finished studies and export them as "
                f"this model's. Sweep into another --out, or set them aside with `kvtune forget {dep} "
                f"--backend <each backend> --out {self.o.out}`" + (" or --retune-stale" if not self.shared else ""))
        stale = stale_sources(table, {be: bi.get("kernel_hash") for be, bi in binfo.items()})
        for be, (n, old, cur) in stale.items():
            if self.o.retune_stale and not self.shared:
                got = forget_backend(str(dep), [be], out=self.o.out, storage=self.storage_url)
                log.warning("%s: %d trial row(s) were measured on kernel source %s, this source is %s: moved to "
                            "trials.forgotten.csv with %d of its studies; tuning it from scratch", be, got["rows"],
                            old, cur, got["studies"])
                continue
            raise ConfigError(
                f"{table}: {n} trial row(s) of {be} were measured on kernel source {old}, "
                f"this {be} source is {cur}; resuming would skip its finished studies. Re-tune it from scratch "
                f"with `kvtune forget {dep} --backend {be} --out {self.o.out}` (its rows move to "
                f"trials.forgotten.csv) before the sweep"
                + (", or with --retune-stale" if not self.shared else " (workers cannot do it themselves)")
                + ", or leave it out with --backend")

    # -- one measurement ------------------------------------------------------------------
    def _measure(self, backend, params, spec, seed, extra: dict | None = None) -> dict:
        self.stops.check()
        if self.o.max_measurements is not None and self.measured_now >= self.o.max_measurements:
            raise SweepStopped("measurement limit")
        if self.o.max_minutes is not None and time.time() - self.t0 > 60 * self.o.max_minutes:
            raise SweepStopped(f"time limit of {self.o.max_minutes:g} min")
        self.measured_now += 1
        return self.runner.measure(backend, params, spec, seed, extra=extra)

    # -- after the studies of one (backend, tp, bs) ---------------------------------------
    def _ok_trials(self, study):
        return sorted((t for t in self._finished(study) if t.user_attrs["outcome"] == "ok"), key=lambda t: t.value)

    def cross_measure(self, backend, tp, bs):
        """Measure the compile-time configs that won some bucket at every other bucket: per
        bucket and candidate, its NSPLIT options in turn until one measures correct."""
        studies = {ctx: self._open_study(backend, tp, bs, ctx) for ctx in self.ctxs}
        oks = {ctx: self._ok_trials(s[1]) for ctx, s in studies.items()}
        cands: dict[str, dict] = {}
        for ctx in self.ctxs:
            for t in oks[ctx][:2] + [t for t in oks[ctx] if t.user_attrs.get("role") == "baseline"]:
                cands.setdefault(compile_key(t.params), dict(t.params))
        plan = [(ctx, options) for ctx in self.ctxs
                for options in self._cross_options(backend, tp, bs, ctx, studies[ctx][1], oks[ctx], cands)]
        for ctx, options in plan:
            for q in options:
                _, m = self.measure_trial(backend, tp, bs, ctx, studies[ctx], q, "cross")
                if m["outcome"] == "ok":
                    break

    def measure_trial(self, backend, tp, bs, ctx, opened, q: dict, role: str):
        """Measure exactly `q` on the bucket's equal requests as a new trial (role `role`) of the
        study `opened` = (name, study, seed); told to the study and appended to the table.
        Returns (trial, measurement)."""
        name, study, seed = opened
        spec = self.runner.spec(tp, bs, ctx)
        dists = {n: tuple(v) for n, v in study.user_attrs["dists"].items()}
        trial, params = self._ask_for(study, q, dists, role)
        try:
            self.runner.prefetch.wait(backend, params, asdict(spec))
            m = self._measure(backend, params, spec, seed + trial.number)
        except BaseException:
            self._interrupted(study, trial)
            raise
        self._tell(study, trial, m, self.runner.row(backend, tp, bs, ctx, spec, name, trial.number, role, params, m))
        self._progress(m, count=False)
        return trial, m

    def _cross_options(self, backend, tp, bs, ctx, study, oks, cands) -> list[list[dict]]:
        """Per candidate: the configs to try here, untried and feasible; their compiles start.
        A candidate this bucket has no correct config of: this bucket's best NSPLIT first, then
        its own. One the search met here only at other NSPLIT values: this bucket's best NSPLIT
        (the kimi-k2-h200 sweep of 2026-12-01 had measured eight copy lanes at tp 2, batch 16,
        4k only at NSPLIT 33, 1.4x the default's NSPLIT 26 there, so the group that won 16k-128k
        by 1.07-1.55x was never compared at 4k on equal terms)."""
        space = self.spaces[backend]
        have = {compile_key(t.params) for t in oks}
        tried = {params_key(t.params) for t in self._finished(study)}
        spec = self.runner.spec(tp, bs, ctx)
        env = problem_env(spec.draft_tokens, spec.heads, bs, ctx, spec.Dk, spec.kv_lora_rank, self.dep.device)
        dists = {n: tuple(v) for n, v in study.user_attrs["dists"].items()}
        nsplits = [oks[0].params["NSPLIT"]] if oks and "NSPLIT" in space.names else []
        out = []
        for ck, p in cands.items():
            if any(p.get(n) not in dists[n] for n in dists if n != "NSPLIT"):
                continue
            if ck in have:
                if not nsplits:
                    continue
                options = [dict(p, NSPLIT=nsplits[0])]
            elif "NSPLIT" in space.names:
                options = [dict(p, NSPLIT=n) for n in dict.fromkeys(nsplits + [p.get("NSPLIT")]) if n is not None]
            else:
                options = [p]
            options = [q for q in options if params_key(q) not in tried and q.get("NSPLIT", 1) in
                       dists.get("NSPLIT", (1,)) and not space.violation(q, env)]
            if options:
                out.append(options)
                self.runner.prefetch.submit(backend, options[0], asdict(spec))
        return out

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
            chosen = oks[ctx][: self.o.remeasure_top] + [per[ck][ctx] for ck in top_keys]
            chosen += [t for t in oks[ctx] if t.user_attrs.get("role") == "baseline"]
            uniq = list({t.number: t for t in chosen}.values())
            # the rows live only in the table (not in the study): each one the table lacks, never
            # measured or lost with a damaged table, is measured (again)
            owed = {(t.number, r) for r in range(self.o.rounds) for t in uniq
                    if not self.table.has({"study": name, "phase": "remeasure", "trial": t.number, "round": r})}
            if not owed or len(uniq) < 2:
                continue
            spec = self.runner.spec(tp, bs, ctx)
            for r in range(self.o.rounds):
                order = uniq[r % len(uniq):] + uniq[: r % len(uniq)]
                for t in order:
                    if (t.number, r) not in owed:
                        continue
                    m = self._measure(backend, dict(t.params), spec, seed + 100003 * (r + 1) + t.number)
                    self.table.append(self.runner.row(backend, tp, bs, ctx, spec, name, t.number,
                                                t.user_attrs.get("role", "search"), dict(t.params), m,
                                                phase="remeasure", rnd=r))
                    self._progress(m, count=False, best=False)

    def after_search(self, backend, tp, bs):
        """The phases after the studies of one (backend, tp, bs), in order: cross-bucket,
        re-measurement, ragged (and the re-measurement again when it measured a new NSPLIT,
        which may have won on equal requests). The export passes over a group slower than the
        default on a ragged batch, so the ragged phase runs again for the pick that takes its
        place, until the pick has been timed (at most RAGGED_PICKS picks)."""
        self.cross_measure(backend, tp, bs)
        self.remeasure(backend, tp, bs)
        if not ragged_applies(self, backend, bs):
            return
        timed = set()
        for _ in range(RAGGED_PICKS):
            df = deployment_trials(self)
            pick = ragged_pick(self, backend, tp, bs, df)
            if pick in timed:
                return
            timed.add(pick)
            if measure_ragged(self, backend, tp, bs, df, pick):
                self.remeasure(backend, tp, bs)
        pick = ragged_pick(self, backend, tp, bs, deployment_trials(self))
        if pick not in timed:
            log.warning("%s tp=%d bs=%d: %d picks in turn gave way on their ragged batches; the export's "
                        "next pick, %s, was not timed on them", backend, tp, bs, RAGGED_PICKS, pick)

    # -- progress and the whole sweep -----------------------------------------------------
    def _progress(self, m, count=True, best=True):
        if self.bar is None:
            return
        if count:
            self.bar.update(1)
        if best and m.get("outcome") == "ok" and (self._best is None or m["median_us"] < self._best[0]):
            self._best = (m["median_us"], m.get("pct_floor"))
        if self._best:
            self.bar.best(self._study, *self._best)

    def run(self) -> list:
        t0 = self.t0 = time.time()
        lock, shared = RunLock(self.out_dir), StorageLock(self.storage, self.storage_url, self.dep.name)
        owner = not self.shared or getattr(self, "post", False)   # the sweep itself, not a worker that joins it
        if owner:
            lock.acquire(" ".join(redact_argv(sys.argv)))
        try:   # every way out but SIGKILL empties the lock: an error is not a killed sweep
            if owner:
                shared.acquire()
            self._run(t0)
        finally:
            try:
                shared.release()
            finally:
                lock.release()
        return self.results

    def _run(self, t0) -> None:
        status = "complete"
        self.stops.install()
        try:
            status = self._work()
            self.stops.check()
        except (KeyboardInterrupt, SweepStopped) as e:
            status = "interrupted" if isinstance(e, KeyboardInterrupt) else f"stopped ({e})"
            log.warning("sweep %s: every finished trial is saved; re-run the same command to resume", status)
        finally:
            self.stops.restore()
            self._close(status)
        dead, buckets = dead_buckets(self.results), {(r.tp, r.bs, r.ctx) for r in self.results}
        if status == "complete" and dead:   # a bucket no backend measured anything at is not a finished one
            status = f"{ALL_PRUNED} at {len(dead)} of {len(buckets)} (tp, batch, context) buckets"
        self.status = status
        self.wall_s = time.time() - t0
        self._log_run(t0)

    def _work(self) -> str:
        """Each (tp, bs, backend): its studies one after another, then the phases after them."""
        self._setup()
        backends = [b for b in self.backends if b in self.spaces]
        if self.o.progress:
            self.bar = Progress(len(backends) * len(self.tps) * len(self.bss) * len(self.ctxs) * self.trials)
        for tp in self.tps:
            for bs in self.bss:
                for be in backends:
                    for ctx in self.ctxs:
                        self._study, self._best = f"{be} tp{tp} bs{bs} ctx{ctx}", None
                        grid = self._plan((be, tp, bs, ctx)).grid
                        if self.bar is not None and grid and len(grid) > self.trials:   # --grid
                            self.bar.expect(len(grid) - self.trials)
                        self.search_study(be, tp, bs, ctx)
                        self.results.append(self._study_result(be, tp, bs, ctx))
                    self._study = f"{be} tp{tp} bs{bs} cross/remeasure/ragged"
                    self.after_search(be, tp, bs)
        return "complete" if backends else "nothing to sweep (every backend was skipped)"

    def _close(self, status: str) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self.runner.close(force=status != "complete")

    def _log_run(self, t0):
        append_jsonl(self.out_dir / "runs.jsonl", self._run_record(t0))

    def _run_record(self, t0) -> dict:
        return {"command": " ".join(redact_argv(sys.argv)), "deployment": self.dep.name, "device": self.device,
                "status": self.status, "start": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
                "wall_s": round(self.wall_s, 1), "measurements": self.measured_now, "skipped": self.skipped,
                "studies": len(self.results), "storage": redact_url(self.storage_url),
                "restarts": getattr(self.executor, "restarts", 0), "provenance": dict(self.info or {})}

    def summary(self) -> str:
        import pandas as pd
        if not self.results:
            if not (self.status == "interrupted" or self.status.startswith("stopped")):
                return "(no studies ran)"
            # stopped before any study's result was gathered here (a --workers sweep gathers them
            # once its workers end): what was measured is kept all the same
            return (f"sweep of {self.dep.name}: status {self.status} after {self.wall_s:.1f} s, with no study's "
                    f"result gathered yet; every finished trial is saved in {self.out_dir / 'trials.csv'} and the "
                    "same command resumes the sweep")
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


def check_device_name(dep: Deployment, info: dict, other_device: bool = False) -> None:
    """A GPU sweep measures the GPU its deployment's device profile names (`device_name`), or
    raises ConfigError naming both; with `other_device`, logs the difference once and goes on.
    H100 and H200 share sm_90 and every kernel: only the name tells their timings apart, and
    the export files this GPU's timings under the deployment's name. `info`: the runner's
    (its `device_name` and `arch`)."""
    prof = dep.device
    if (prof.device_name, prof.arch) == (info["device_name"], info["arch"]):
        return
    msg = (f"{dep.source}: device {prof.name!r} ({prof.source}) is {prof.device_name!r} ({prof.arch}), this GPU "
           f"is {info['device_name']!r} ({info['arch']}): the export would file this GPU's timings under "
           f"{dep.name!r}, with floors from the profile's ceilings")
    if not other_device:
        raise ConfigError(msg + "; sweep a deployment whose device profile names this GPU (`kvtune calibrate "
                          "--deployment-for <family>` finds or writes one), or pass --other-device")
    log.warning("%s (--other-device)", msg)


def run_sweep(deployment, opts: SweepOptions | None = None, **kw) -> Sweep:
    """Sweep a deployment (a path, a name, or a Deployment); returns the finished Sweep."""
    dep = deployment if isinstance(deployment, Deployment) else load_deployment(deployment)
    sw = Sweep(dep, opts or SweepOptions(**kw))
    sw.run()
    return sw
