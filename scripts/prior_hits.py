"""How good a guess the previous kernel source's winners are for a re-tune (`tuner/priors.py`).

Given two trials tables of one deployment, swept on an older and a newer source of a backend,
it prints per bucket whether the older source's winner (as `load_priors` picks it) is the newer
sweep's best, and how far it is from that best where the newer sweep measured it. Both tables
are read as a re-tune reads its set-aside one (`tuner.priors.bucket_latencies`: the search-phase
ok rows of each bucket's newest source); CPU only.

    python scripts/prior_hits.py OLD_TRIALS.csv NEW_TRIALS.csv --backend wgmma
"""
from __future__ import annotations

import argparse
import sys

from kvtune.tuner.priors import bucket_latencies, load_priors
from kvtune.tuner.strategy import params_key


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", help="trials table of the older source (its rows are what `kvtune forget` sets aside)")
    ap.add_argument("new", help="trials table of the newer source")
    ap.add_argument("--backend", default="wgmma")
    ap.add_argument("--within", type=float, default=0.02, help="the tolerance counted (default 0.02: 2%%)")
    a = ap.parse_args(argv)
    priors = {k: v for k, v in load_priors(a.old).items() if k[0] == a.backend}
    found = {k: v for k, v in bucket_latencies(a.new).items() if k[0] == a.backend}
    if not found:
        raise SystemExit(f"{a.new}: no rows of backend {a.backend!r}")
    bests = {k: lat for k, (_, lat) in found.items()}
    source = ", ".join(sorted({src for src, _ in found.values()}))
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
