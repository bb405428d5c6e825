"""How a study chooses what to measure next: the TPE sampler and the configs queued for it.

One place for the search decisions of the study loop (`tuner/study.py`), which the sweep
(one process) and the workers sharing the studies both run, so that `tuner/replay.py`
replays exactly what a sweep does. A study measures, in order: the backend's default (the baseline), the neighbouring
buckets' winners (warm starts), then what TPE proposes; a space no larger than the budget
is swept whole instead (`StudyLoop._study_plan`, `tuner/study.py`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass


#: roles of trials measured beside the search, not proposed by it: the winners of other buckets
#: (cross) and NSPLIT candidates of the ragged phase (ragged). They never count against a study's
#: budget, never steer a warm start, and are measured whatever the space's constraints say.
BESIDE_SEARCH = ("cross", "ragged")


@dataclass(frozen=True)
class SearchStrategy:
    """Settings of the per-study search (the defaults are the sweep's policy)."""

    startup: int | None = None       # TPE's random start-up trials (None: max(2, min(6, budget // 3)))
    multivariate: bool = True
    n_ei_candidates: int = 24
    local_every: int = 2             # after start-up, every k-th config: a neighbour of the incumbent (0: never)
    count_pruned: bool = False       # configs pruned before measuring (compile, spills, smem) count against the budget
    rounds: int = 6                  # batches of at most max(2, ceil(budget / rounds)) configs (see width)

    def n_startup(self, trials: int) -> int:
        return self.startup if self.startup is not None else max(2, min(6, trials // 3))

    def sampler(self, optuna, seed: int, trials: int):
        """The study's sampler (constant liar: several configs are asked before any is told)."""
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=self.n_startup(trials),
                                          multivariate=self.multivariate, n_ei_candidates=self.n_ei_candidates,
                                          constant_liar=True)

    def width(self, workers: int, trials: int) -> int:
        """Configs asked at once (compiled ahead in parallel, told to TPE only when measured):
        min(max(1, workers), max(2, ceil(trials / rounds))); never under 2 when there are 2
        compile workers or more, so with budgets under 2 * rounds (12 by default) a batch holds
        more than budget / rounds configs."""
        return min(max(1, workers), max(2, -(-trials // self.rounds)))

    def counts(self, attrs: dict) -> bool:
        """Whether a finished trial (its user attributes) counts against the study's budget."""
        if attrs.get("role", "search") in BESIDE_SEARCH or attrs.get("constraint"):
            return False
        return self.count_pruned or attrs.get("outcome") != "pruned"

    def is_local(self, n_search: int, trials: int) -> bool:
        """Whether the config asked after `n_search` counted ones is a neighbour of the incumbent."""
        k = n_search - self.n_startup(trials)
        return self.local_every > 0 and k >= 0 and k % self.local_every == 0


DEFAULT = SearchStrategy()


def params_key(params: dict) -> str:
    return json.dumps(params, sort_keys=True)


def neighbours(params: dict, dists: dict) -> list[dict]:
    """Configs one step away from `params` in one parameter (choices in their listed order)."""
    out = []
    for n, vals in dists.items():
        vals = list(vals)
        if params.get(n) not in vals:
            continue
        i = vals.index(params[n])
        out += [dict(params, **{n: vals[j]}) for j in (i - 1, i + 1) if 0 <= j < len(vals)]
    return out


def local_proposal(ranked: list[dict], dists: dict, taken: set, feasible, rng) -> dict | None:
    """An untried feasible neighbour of the best config that has one (`ranked`: best first)."""
    for p in ranked:
        cands = [q for q in neighbours(p, dists) if params_key(q) not in taken and feasible(q)]
        if cands:
            return rng.choice(cands)
    return None
