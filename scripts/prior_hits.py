"""How good a guess the previous kernel source's winners are for a re-tune (`tuner/priors.py`).

Given two trials tables of one deployment, swept on an older and a newer source of a backend,
it prints per bucket whether the older source's winner (as `load_priors` picks it) is the newer
sweep's best, and how far it is from that best where the newer sweep measured it. It reads the
newer table's search-phase ok rows of the newer source; CPU only.

    python scripts/prior_hits.py OLD_TRIALS.csv NEW_TRIALS.csv --backend wgmma
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

from kvtune.tuner.priors import load_priors
from kvtune.tuner.strategy import BESIDE_SEARCH, params_key
from kvtune.tuner.table import scan_table


def newest_source_bests(path, backend: str) -> tuple[str, dict]:
    """(the newest source of `backend` in the table, per bucket {params key: median latency})."""
    _, rows, _, _ = scan_table(path)
    mine = [r for r in rows if r.get("backend") == backend and r.get("kernel_hash")]
    if not mine:
        raise SystemExit(f"{path}: no rows of backend {backend!r}")
    source = max(mine, key=lambda r: r.get("date") or "")["kernel_hash"]
    by: dict = {}
    for r in mine:
        if (r["kernel_hash"] != source or r.get("phase") != "search" or r.get("outcome") != "ok"
                or r.get("role") in BESIDE_SEARCH):
            continue
        key = (backend, int(float(r["heads"])), int(float(r["bs"])), int(float(r["ctx"])), int(float(r["T"])),
               r.get("tree") or "")
        by.setdefault(key, {}).setdefault(params_key(json.loads(r["params"])), []).append(float(r["median_us"]))
    return source, {k: {p: statistics.median(v) for p, v in c.items()} for k, c in by.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", help="trials table of the older source (its rows are what `kvtune forget` sets aside)")
    ap.add_argument("new", help="trials table of the newer source")
    ap.add_argument("--backend", default="wgmma")
    ap.add_argument("--within", type=float, default=0.02, help="the tolerance counted (default 0.02: 2%%)")
    a = ap.parse_args(argv)
    priors = {k: v for k, v in load_priors(a.old).items() if k[0] == a.backend}
    source, bests = newest_source_bests(a.new, a.backend)
    same = measured = close = 0
    print(f"{'heads':>5} {'bs':>3} {'ctx':>7}  {'prior is best':>13}  {'prior vs best':>13}")
    for key in sorted(bests):
        times = bests[key]
        best = min(times, key=times.get)
        prior = priors.get(key)
        if prior is None:
            continue
        k = params_key(prior)
        same += k == best
        gap = times[k] / times[best] - 1 if k in times else None
        measured += gap is not None
        close += gap is not None and gap <= a.within
        print(f"{key[1]:>5} {key[2]:>3} {key[3]:>7}  {'yes' if k == best else 'no':>13}  "
              f"{'-' if gap is None else f'{gap:+.1%}':>13}")
    n = sum(1 for key in bests if key in priors)
    print(f"\n{a.backend}, newer source {source}: {n} buckets with a prior; the prior is the best at {same}; "
          f"measured by the newer sweep at {measured}, within {a.within:.0%} of its best at {close}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
