"""The winners of trials set aside (`trials.forgotten.csv`) as a re-tune's first guesses.

When a backend's kernel source changes, `kvtune forget` or `--retune-stale` move its trials to
`trials.forgotten.csv` and its studies start over: code that no longer runs measured them, so
they cannot be exported. Their winners are still the best guess at the new source's. Across the
committed kimi-k2-h200 re-sweeps (wgmma, 64 buckets, 8 trials each), the previous source's best
config was the new sweep's best at 51 buckets after a merge-only change (`a49ab3f7f3ee9b50` ->
`d095c426ae3d9e78`), and at 33 after a tile-loop change (`cbd45c00218b1e02` ->
`a49ab3f7f3ee9b50`). Where the new sweep happened to measure it, it was within 2% of that
sweep's best at 56 of 58 and 39 of 53 buckets (`results/sweep-cost/retune-priors/`). So each
study measures its bucket's previous winner right after the baseline (role "prior"), before the
neighbours' warm starts and TPE. The prior counts against the study's budget like a warm start,
and is measured anew; no latency is carried over.

Per bucket the winner is taken from the newest kernel source set aside there, the one a re-tune
follows. It is looked up by the bucket's measured shape (heads, batch, context, T, tree), not by
study name, so rows of another model never seed a study.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from kvtune.kernels.backends import rename_legacy_params

from .log import get_logger
from .strategy import BESIDE_SEARCH, params_key
from .table import scan_table

log = get_logger(__name__)

FORGOTTEN = "trials.forgotten.csv"


def _int(v) -> int | None:
    try:
        return int(float(v))
    except (TypeError, ValueError):
        return None


def bucket_latencies(path: str | Path) -> dict[tuple, tuple[str, dict[str, float]]]:
    """Per (backend, heads, bs, ctx, T, tree): (the bucket's newest kernel source in `path`, the
    kernel hash of its newest row by `date`; {params key: median latency} of the search-phase
    trials measured ok on that source, each median over that config's rows of the bucket).
    `path` is a trials table, usually `<out>/<deployment>/trials.forgotten.csv`. Rows beside the
    search (cross, ragged), rows without a latency or a shape, and rows whose params do not parse
    are skipped. A missing or empty file gives {}."""
    path = Path(path)
    if not path.is_file() or not path.stat().st_size:
        return {}
    _, rows, bad, _ = scan_table(path)
    if bad:
        log.warning("%s: %d torn or malformed line(s) skipped for the re-tune's first guesses", path, len(bad))
    seen: dict[tuple, list] = {}   # bucket -> its eligible rows, parsed: (date, hash, params key, us)
    for r in rows:
        be = r.get("backend") or ""
        if r.get("phase") != "search" or r.get("outcome") != "ok" or r.get("role") in BESIDE_SEARCH or not be:
            continue
        shape = tuple(_int(r.get(c)) for c in ("heads", "bs", "ctx", "T"))
        try:
            us = float(r.get("median_us"))
            params = rename_legacy_params(be, json.loads(r.get("params") or ""))
        except (TypeError, ValueError):
            continue
        if None in shape or not isinstance(params, dict) or not params or not us == us:   # NaN: no latency
            continue
        seen.setdefault((be,) + shape + (r.get("tree") or "",), []).append(
            (r.get("date") or "", r.get("kernel_hash") or "", params_key(params), us))
    out = {}
    for key, got in seen.items():
        source = max(got)[1]   # the newest row's kernel source
        by: dict[str, list] = {}
        for _, h, k, us in got:
            if h == source:
                by.setdefault(k, []).append(us)
        out[key] = (source, {k: statistics.median(v) for k, v in by.items()})
    return out


def load_priors(path: str | Path) -> dict[tuple, dict]:
    """Per (backend, heads, bs, ctx, T, tree), the config of least median latency in `path` on
    the bucket's newest kernel source there (`bucket_latencies`; ties: the lesser params key)."""
    return {key: json.loads(min(lat, key=lambda k: (lat[k], k))) for key, (_, lat) in bucket_latencies(path).items()}
