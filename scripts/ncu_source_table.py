#!/usr/bin/env python3
"""Diagnosis (not a test): read the per-instruction CSV that scripts/profile.sh saves
(`ncu --page source --csv --print-source sass`, SourceCounters) and print, for the profiled kernel:
the instructions with the most excess shared-memory wavefronts (bank conflicts) and excess global
sectors (uncoalesced accesses), the most-sampled instructions with their stall reasons, and the
stall samples summed per code region. Regions are named by their first instruction's offset
from the kernel's start (read them off the SASS, e.g. the first HGMMA of the tile loop).

    python scripts/ncu_source_table.py sass_131072.csv.gz --regions "prologue:0,main loop:b990,tail:17750"
    python scripts/ncu_source_table.py sass_131072.csv.gz --regions "main loop:b990,after:12250" --mix 4092
"""
from __future__ import annotations

import argparse
import collections
import csv
import gzip
import sys


def _num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def load(path: str) -> list[dict]:
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        rows = list(csv.reader(f))
    hdr = next(r for r in rows if "Address" in r and "Source" in r)
    data = [dict(zip(hdr, r)) for r in rows[rows.index(hdr) + 1:] if len(r) == len(hdr)]
    if not data:
        raise SystemExit(f"{path}: no instruction rows under a header with Address and Source")
    base = int(data[0]["Address"], 16)
    for d in data:
        d["offset"] = int(d["Address"], 16) - base
    return data


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--regions", default="all:0", help="name:hex_offset,... in ascending offsets")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--mix", type=float, default=0, help="also print each region's executed instructions by "
                    "opcode, divided by this (e.g. CTAs x tiles per CTA: per tile)")
    args = ap.parse_args(argv)
    data = load(args.csv)
    regions = [(name, int(off, 16)) for name, off in (r.rsplit(":", 1) for r in args.regions.split(","))]
    for d in data:   # the region an instruction falls in: the last that starts at or before it
        d["region"] = ([n for n, off in regions if d["offset"] >= off] or ["before"])[-1]
    stalls = [k for k in data[0] if k.startswith("stall_") and "Not Issued" not in k]
    src = lambda d: " ".join(d["Source"].split())[:70]  # noqa: E731
    for metric in ("L1 Wavefronts Shared Excessive", "L2 Theoretical Sectors Global Excessive"):
        tot = sum(_num(d[metric]) for d in data)
        print(f"\n== {metric}: {tot:.0f} in all; the top {args.top}")
        for d in sorted(data, key=lambda d: -_num(d[metric]))[:args.top]:
            print(f"{d['offset']:6x} {_num(d[metric]):9.0f}  {src(d)}")
    total = sum(_num(d["# Samples"]) for d in data)
    print(f"\n== warp stall samples: {total:.0f} in all; the top {args.top} instructions")
    for d in sorted(data, key=lambda d: -_num(d["# Samples"]))[:args.top]:
        why = sorted(((k[6:], _num(d[k])) for k in stalls if _num(d[k]) > 0), key=lambda kv: -kv[1])[:2]
        print(f"{d['offset']:6x} {_num(d['# Samples']):6.0f}  {src(d):70s} {', '.join(f'{k} {v:.0f}' for k, v in why)}")
    agg = collections.defaultdict(collections.Counter)
    for d in data:
        for k in stalls:
            agg[d["region"]][k[6:]] += _num(d[k])
    print("\n== stall samples per region")
    for name, c in sorted(agg.items(), key=lambda kv: -sum(kv[1].values())):
        s = sum(c.values())
        if s:
            top = ", ".join(f"{k} {100 * v / s:.0f}%" for k, v in c.most_common(5))
            print(f"{name:28s} {s:6.0f} {100 * s / total:5.1f}%  {top}")
    if args.mix:
        _print_mix(data, args.mix, args.top)
    return 0


def _print_mix(data: list[dict], per: float, top: int) -> None:
    """Executed warp instructions per region and opcode (the predicate and operands left out), / per."""
    mix = collections.defaultdict(collections.Counter)
    for d in data:
        words = d["Source"].split()
        op = words[1] if words and words[0].startswith("@") and len(words) > 1 else (words or ["?"])[0]
        mix[d["region"]][op] += _num(d["Instructions Executed"])
    for name, c in mix.items():
        print(f"\n== executed instructions in {name}: {sum(c.values()) / per:.0f} per unit; the top {top} opcodes")
        for op, n in c.most_common(top):
            print(f"  {op:32s} {n / per:9.1f}")


if __name__ == "__main__":
    sys.exit(main())
