#!/usr/bin/env python3
"""Diagnosis (not a test): the wgmma kernel on small odd shapes, for compute-sanitizer racecheck.

`--publish sync` compiles a copy of verify_wgmma.cu in which the warpgroup that publishes a tile
(its P, row maxima and rescale factors) waits at the publication barrier (bar.sync) instead of
only arriving (bar.arrive): the same ordering of the shared-memory handoff, stated with a barrier
both sides wait at. Racecheck hazards that the arrive/sync handoff shows and the sync/sync one
does not are the tool's reading of bar.arrive, not a race in the kernel (`racecheck_probe.py`
shows the tool flagging a race-free bar.arrive / bar.sync handoff). `--variant` applies one of
`time_phases.py`'s stage-left-out patches on top (outputs then wrong, only the hazards count):
which stage the remaining reports need. `--rows` limits the ROWS values run.

    compute-sanitizer --tool racecheck python3 scripts/racecheck_wgmma.py [--publish sync]
    compute-sanitizer --tool racecheck python3 scripts/racecheck_wgmma.py --publish sync --variant no_tiles --rows 64
"""
import argparse

import torch

from kvtune.kernels import get_backend, make_inputs, reference_attention, rel_error, verify_attention
from kvtune.kernels.cuda import nvrtc
from kvtune.kernels.cuda.params import WgmmaParams

ap = argparse.ArgumentParser()
ap.add_argument("--publish", choices=("arrive", "sync"), default="arrive")
ap.add_argument("--variant", default="full", help="a time_phases.py variant of the wgmma kernel (outputs wrong)")
ap.add_argument("--rows", default="64,72", help="ROWS values to run")
args = ap.parse_args()
text = nvrtc.SOURCE_PATH.with_name("verify_wgmma.cu").read_text()
if args.publish == "sync":
    old = "bar_arrive(3 + (t & 1), 256);"
    if text.count(old) != 1:
        raise SystemExit(f"verify_wgmma.cu: the publication `{old}` is not there once; update this script")
    text = text.replace(old, "bar_sync(3 + (t & 1), 256);")
if args.variant != "full":
    from time_phases import patched_source
    text = patched_source(text, args.variant, "wgmma")
rows_run = [int(r) for r in args.rows.split(",")]
with nvrtc.source_override(text, "verify_wgmma.cu"):
    get_backend("wgmma")._kernels.clear()
    for (B, T, H, prefix, tree) in [(1, 9, 8, [54], "chain"), (3, 1, 8, [97, 1, 7], "chain"),
                                    (2, 16, 16, [300, 5], "random"), (1, 2, 64, [1000], "random")]:
        x = make_inputs(B, T, H, prefix, tree=tree, device="cuda", seed=B * 100 + T)
        ref, _ = reference_attention(*x.args)
        for rows, lanes in ((64, 4), (72, 4), (72, 8)):  # the tail's handoffs only exist at 72; both gathers
            if rows not in rows_run:
                continue
            o = verify_attention(*x.args, backend="wgmma", params=WgmmaParams(NSPLIT=4, ROWS=rows, COPY_LANES=lanes))
            torch.cuda.synchronize()
            print(args.publish, args.variant, rows, lanes, B, T, H, prefix, tree, "rel err",
                  round(rel_error(o, ref), 5), flush=True)
