"""The export's serving check: the config export picks, run the way serving runs it.

A pick is measured at every context bucket with `params.NSPLIT` = the largest bucket NSPLIT
and a SplitTable choosing each bucket's NSPLIT on the device (one graph-capturable launch):
a correctness gate and a timing. Its rows go to the trials table as phase `serve`, round
`export.serve_key(...)`, trial 0, role `export` (the schema earlier sweeps wrote them in), so
a check is measured once and read back by every later export; a config that fails it is
skipped for the next best (`export.pick_served`). A per-context dispatch (`dispatch.with_dispatch`)
is checked the same way with every config launched in each call, role `dispatch`, and on each
moved bucket's ragged batch too (`ragged`, its own round).

Only the machine that measured the trials can check them: the check runs on the device of
the table's rows (its `device` name must be this machine's), else export uses the checks
recorded in the table and says so.
"""
from __future__ import annotations

from .config import Deployment
from .executor import WorkerError
from .log import get_logger
from .study import study_name
from .table import TrialsTable

log = get_logger(__name__)


class ServingCheck:
    """Callable `(backend, params, split_table, tp, bs, contexts, key) -> rows or None`: measures
    one pick at each of `contexts` and appends its rows (round `key`) to the trials table;
    None when this machine cannot (another device, or the backend does not run here)."""

    def __init__(self, dep: Deployment, table_path, device_name: str, arch: str, timing: str | None, seed: int = 0):
        self.dep, self.table_path, self.seed = dep, table_path, seed
        self.device_name, self.arch = device_name, arch
        self.timing = timing
        self.runner = None
        self.unavailable = None    # why this machine cannot check (said once)
        self.tables: dict = {}

    def _start(self, backend) -> bool:
        if self.unavailable:
            return False
        if self.runner is None:
            from .runner import Runner, default_device
            device = "cpu" if self.arch == "cpu" else "cuda"
            if device == "cuda" and default_device() != "cuda":
                return self._cannot("no CUDA GPU is visible here")
            timing = self.timing if self.timing in ("graph", "eager") else None
            self.runner = Runner(self.dep, device, timing=timing, compile_workers=0)
            try:
                self.runner.setup([])
            except WorkerError as e:
                return self._cannot(f"its trial worker failed ({e})")
            here = str(self.runner.info.get("device_name"))
            if here != self.device_name:
                return self._cannot(f"this machine is {here}")
        if backend not in self.runner.binfo:
            try:
                self.runner.setup([backend])
            except WorkerError as e:
                return self._cannot(f"its trial worker failed ({e})")
            if backend not in self.runner.binfo:
                return self._cannot(f"backend {backend} does not run here ({self.runner.skipped.get(backend)})")
        if backend not in self.tables:
            self.tables[backend] = TrialsTable(self.table_path, self.runner.binfo[backend]["fields"])
        return True

    def _cannot(self, why: str) -> bool:
        self.unavailable = why
        log.warning("the serving check of the exported configs is not measured here: the trials were measured on "
                    "%s and %s; only checks recorded in the trials table count", self.device_name, why)
        return False

    def __call__(self, backend, params, split_table, tp, bs, contexts, key, dispatch=None) -> list[dict] | None:
        """`dispatch`: a per-context dispatch's other launches ([params, split table], and their
        backend third where it is not `backend`), run after `params` in every call as serving
        runs them."""
        return self._check(backend, params, split_table, tp, bs, contexts, key, dispatch, ragged=False)

    def ragged(self, backend, params, split_table, tp, bs, contexts, key, dispatch=None) -> list[dict] | None:
        """The same launches on each of `contexts`' ragged batch (`tuner.measure.ragged_prefixes` at
        the deployment's spread: the batch the sweep's ragged phase times), rows under round `key`."""
        return self._check(backend, params, split_table, tp, bs, contexts, key, dispatch, ragged=True)

    def _check(self, backend, params, split_table, tp, bs, contexts, key, dispatch, ragged: bool):
        if not self._start(backend):
            return None
        r = self.runner
        rows = []
        extra = {"split_table": split_table, **({"dispatch": dispatch} if dispatch else {})}
        for ctx in contexts:
            spec = r.spec(tp, bs, ctx)
            if ragged:
                spec = spec.ragged(self.dep.ragged_spread)
            m = r.measure(backend, params, spec, self.seed + 7 * ctx, extra=extra)
            # role "dispatch": the check of a per-context dispatch (its params are the entry's own
            # launch; a failure says nothing about that config alone)
            row = r.row(backend, tp, bs, ctx, spec, study_name(self.dep.name, backend, tp, bs, ctx), 0,
                        "dispatch" if dispatch else "export", params, m, phase="serve", rnd=key)
            self.tables[backend].append(row)
            rows.append(row)
        log.info("serving check%s of tp=%s bs=%s %s %s%s: %s", " on the ragged batches" if ragged else "", tp, bs,
                 backend, params,
                 f" with {[(d[2] + ' ' if len(d) > 2 else '') + str(d[0]) for d in dispatch]} at their buckets"
                 if dispatch else "",
                 ", ".join(f"{r['ctx']}: {r['outcome']}" for r in rows))
        return rows

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()
