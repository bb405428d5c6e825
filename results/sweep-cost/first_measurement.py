import json, sys, time
from dataclasses import replace
from kvtune.tuner.measure import Ceilings, MeasureOptions, Measurer, ProblemSpec, ragged_prefixes
m = Measurer("cuda")
ceil = Ceilings(4190.0, 630.0)
rows = []
for (H, B, ctx, rag) in [(8, 64, 131072, False), (8, 64, 131072, True), (16, 64, 65536, False), (8, 16, 131072, False)]:
    spec = ProblemSpec(heads=H, batch=B, context=ctx, draft_tokens=9, tree="random", sm_scale=0.1309)
    if rag:
        spec = replace(spec, prefixes=ragged_prefixes(B, ctx, 8.0))
    for i in range(2):
        r = m.measure("cuda", None, spec, MeasureOptions(timing="graph"), ceil)
        rows.append({"H": H, "B": B, "ctx": ctx, "ragged": rag, "call": i, "outcome": r.outcome, "wall_s": round(r.wall_s, 2),
                     "median_us": r.median_us, "rel_err": r.rel_err})
        print(json.dumps(rows[-1]), flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
