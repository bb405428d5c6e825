"""What a re-export changed: two tuned-defaults YAMLs compared bucket by bucket.

    python scripts/diff_defaults.py OLD.yaml NEW.yaml              # a table of the changed buckets
    python scripts/diff_defaults.py OLD.yaml NEW.yaml --changed    # "tp batch ctx,ctx" per changed entry

A bucket changed when the config that serves it (backend, compile-time params, NSPLIT) differs;
the table gives each file's own recorded latencies (`latency_us`, `ragged_us`: the export's
measurements, informational). `--changed` prints one line per changed (tp, max_batch) entry with
its changed buckets' max_context, for a shell loop that serves both files there. Exit status 0
either way; 2 when a file does not load (the loader's error names the file and key).
"""
from __future__ import annotations

import argparse
import json
import sys


def _served(entry, b) -> str:
    be, params = entry.served_by(b)
    return json.dumps(dict(params, backend=be, NSPLIT=b.NSPLIT), sort_keys=True)


def changes(old, new) -> list[dict]:
    """Per (tp, max_batch, max_context) present in either file where the serving config differs:
    {tp, batch, ctx, old, new (config JSON or None), and each file's latency_us / ragged_us}."""
    def index(d):
        return {(e.tp, e.max_batch, b.max_context): (e, b) for e in d.entries for b in e.buckets}
    a, z = index(old), index(new)
    out = []
    for key in sorted(set(a) | set(z)):
        ea, ez = a.get(key), z.get(key)
        sa = _served(*ea) if ea else None
        sz = _served(*ez) if ez else None
        if sa == sz:
            continue
        row = {"tp": key[0], "batch": key[1], "ctx": key[2], "old": sa, "new": sz}
        for tag, got in (("old", ea), ("new", ez)):
            row[f"{tag}_us"] = got[1].latency_us if got else None
            row[f"{tag}_ragged_us"] = got[1].ragged_us if got else None
        out.append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--changed", action="store_true", help="one 'tp batch ctx,ctx' line per changed entry")
    a = ap.parse_args(argv)
    from kvtune.kernels.tuned import SchemaError, load_tuned
    try:
        old, new = load_tuned(a.old), load_tuned(a.new)
    except (OSError, SchemaError) as e:
        print(f"diff_defaults.py: {e}", file=sys.stderr)
        return 2
    rows = changes(old, new)
    if a.changed:
        per: dict = {}
        for r in rows:
            per.setdefault((r["tp"], r["batch"]), []).append(str(r["ctx"]))
        for (tp, bs), ctxs in per.items():
            print(tp, bs, ",".join(ctxs))
        return 0
    if not rows:
        print(f"no bucket changed ({len([b for e in new.entries for b in e.buckets])} buckets)")
        return 0

    def f(v):
        return "-" if v is None else f"{v:.1f}"
    print("| tp | batch | ctx | old config | new config | old us | new us | old ragged us | new ragged us |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tp']} | {r['batch']} | {r['ctx']} | `{r['old']}` | `{r['new']}` | {f(r['old_us'])} | "
              f"{f(r['new_us'])} | {f(r['old_ragged_us'])} | {f(r['new_ragged_us'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
