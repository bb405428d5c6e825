"""The exported per-deployment YAML: schema, strict loading and writing.

Written by `kvtune export`, read at serving time by the runtime. Lives with the kernels
(not the tuner) because serving reads it; it needs only PyYAML.

Schema (version 1); `dump_tuned` adds a first and a last comment line (EXPORT_HEADER,
EXPORT_TRAILER), and `load_tuned` refuses a file with the first but not the last (cut short)::

    schema_version: 1
    deployment: kimi-k2-h200            # name of the deployment config it came from
    model: {name: Kimi-K2, num_heads: 64, kv_lora_rank: 512, qk_rope_head_dim: 64,
            draft_tokens: 9, sm_scale: 0.0721}
    provenance: {device_name: NVIDIA H200, arch: sm_90, sm_count: 132, driver: "580.159.04",
                 cuda: "13.0", nvrtc: "13.0", torch: "2.11.0", triton: "3.6.0",
                 kernel_hash: {triton: "<sha256[:16]>", cuda: "<sha256[:16]>"},
                 date: "2026-11-29T18:00:00Z", timing: graph, kvtune: "0.1.0"}
    entries:                            # one per (tp, batch bucket)
      - tp: 8
        heads_per_rank: 8
        max_batch: 1                    # serves batches up to this size (first entry that fits)
        backend: cuda                   # reference | triton | cuda | wgmma | wgmma_km
        params: {NSPLIT: 32, VEC: 8, ...}   # the backend's parameter dataclass; NSPLIT = grid
        buckets:                        # NSPLIT per context bucket (context = prefix tokens P_b)
          - {max_context: 4096, NSPLIT: 8, latency_us: 9.1, default_latency_us: 14.0, floor_us: 5.2}
          - {max_context: 131072, NSPLIT: 32}
      - tp: 4                           # a per-context dispatch (cuda, wgmma, wgmma_km entries)
        max_batch: 64
        backend: wgmma
        params: {NSPLIT: 66, ROWS: 72, COPY_LANES: 4}
        buckets:
          - {max_context: 4096, NSPLIT: 66}
          - {max_context: 65536, NSPLIT: 33, params: {ROWS: 72, COPY_LANES: 8}}
          - {max_context: 131072, NSPLIT: 132, backend: wgmma_km, params: {DV_SPLIT: 192, SPLIT_ALIGN: 64}}
      - tp: 8                           # a batch bucket > 1: also timed on a ragged batch
        max_batch: 64
        ...
        buckets:
          - {max_context: 4096, NSPLIT: 132, latency_us: 520.0, default_latency_us: 510.0,
             floor_us: 75.0, ragged_us: 511.0, default_ragged_us: 793.0}

Bucket policy: a request with prefix P uses the first bucket with P <= max_context, and the
last bucket beyond it; a batch of size n uses the first entry of its tp with n <= max_batch,
and the largest entry beyond it. Every bucket's NSPLIT is <= params.NSPLIT.

A bucket's `params` (optional) names the compile-time parameters of its own config where it is
not the entry's (a per-context dispatch, written by `kvtune export` where the sweep measured
another config faster there by more than the dispatch costs): the runtime launches each
distinct config of the entry on every call, and the one whose buckets hold the batch's runs
while the others exit at once (`TunedEntry.configs`). Those buckets' NSPLIT are within their
own config's grid (the largest of them), not params.NSPLIT.

A bucket's `backend` (optional, with `params`) puts it on another backend's kernel: `params` are
then that backend's compile-time parameters in full (all but NSPLIT), and the bucket is served by
that backend's launch in the same way. Every backend of such an entry counts NSPLIT over the
batch (cuda, wgmma, wgmma_km: their launches share the split table's 0-means-idle rule), and
each backend an entry launches has its `provenance.kernel_hash`.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .shapes import MAX_DRAFT_TOKENS

SCHEMA_VERSION = 1
BACKEND_NAMES = ("reference", "triton", "cuda", "wgmma", "wgmma_km")
PROVENANCE_KEYS = ("device_name", "arch", "sm_count", "driver", "cuda", "nvrtc", "torch", "triton",
                   "kernel_hash", "date", "timing", "kvtune")
MODEL_KEYS = ("name", "num_heads", "kv_lora_rank", "qk_rope_head_dim", "draft_tokens", "sm_scale")


# a bucket's optional measurements (us), as the sweep measured them
_BUCKET_TIMES = ("latency_us", "default_latency_us", "floor_us", "ragged_us", "default_ragged_us")


class SchemaError(ValueError):
    """A tuned-defaults file does not follow the schema; the message names file and key."""


#: the first and the last line `dump_tuned` writes: a file that starts with the first and does not
#: end with the last was cut short (a copy or transfer that stopped), which YAML alone often
#: cannot tell (a list cut between entries, a number cut between digits)
EXPORT_HEADER = "# kvtune tuned defaults (written by `kvtune export`); the last line marks the end of the file"
EXPORT_TRAILER = "# end of kvtune tuned defaults"


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last)."""


def _unique_mapping(loader, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"key {key!r} given twice in one mapping",
                                                    key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def yaml_load(text: str) -> Any:
    """yaml.safe_load, but a key given twice in one mapping is a yaml.YAMLError (shared with the
    tuner's config files)."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


@dataclass(frozen=True)
class ContextBucket:
    max_context: int
    NSPLIT: int
    latency_us: float | None = None
    default_latency_us: float | None = None
    floor_us: float | None = None
    # batch buckets > 1: the bucket's ragged batch (the sweep's `ragged_spread`) at this NSPLIT
    # and at the default; the NSPLIT is the one whose worse ratio to the best over equal and
    # ragged requests is least, so latency_us may exceed default_latency_us by that ratio
    ragged_us: float | None = None
    default_ragged_us: float | None = None
    # a per-context dispatch: the backend serving this bucket where it is not the entry's (None:
    # the entry's), and this bucket's compile-time parameters (no NSPLIT) where they are not the
    # entry's (None: the entry's; with `backend`: that backend's, all of them)
    backend: str | None = None
    params: dict | None = None


@dataclass(frozen=True)
class TunedEntry:
    tp: int
    heads_per_rank: int
    max_batch: int
    backend: str
    params: dict
    buckets: tuple[ContextBucket, ...]

    def bucket_for(self, context: int) -> ContextBucket:
        for b in self.buckets:
            if context <= b.max_context:
                return b
        return self.buckets[-1]

    def served_by(self, b: ContextBucket) -> tuple[str, dict]:
        """(backend, compile-time params but NSPLIT) that serve bucket `b`: under a per-context
        dispatch the bucket's own (all of them on another backend, else over the entry's), else
        the entry's."""
        if b.backend:
            return b.backend, dict(b.params)
        return self.backend, {k: v for k, v in dict(self.params, **(b.params or {})).items() if k != "NSPLIT"}

    def configs(self) -> list[tuple[str, dict, list[int]]]:
        """The compile-time configs this entry launches on every call: (their backend, their
        params, NSPLIT as the grid, the largest of their buckets'; NSPLIT per bucket, 0 where
        another config serves it). The entry's own config first (its NSPLIT: params.NSPLIT), then
        each other in the order of its first bucket. One config unless some bucket has `params`."""
        own = {k: v for k, v in self.params.items() if k != "NSPLIT"}
        groups: dict[str, tuple[str, dict, list[int]]] = {
            json.dumps([self.backend, own], sort_keys=True): (self.backend, own, [])}
        for i, b in enumerate(self.buckets):
            be, cp = self.served_by(b)
            groups.setdefault(json.dumps([be, cp], sort_keys=True), (be, cp, []))[2].append(i)
        out = []
        for n, (be, cp, idx) in enumerate(groups.values()):
            ns = [b.NSPLIT if i in idx else 0 for i, b in enumerate(self.buckets)]
            grid = self.params.get("NSPLIT", max(ns)) if n == 0 else max(ns)
            out.append((be, dict(cp, NSPLIT=grid) if "NSPLIT" in self.params else dict(cp), ns))
        return out

    def backends(self) -> list[str]:
        """Every backend this entry launches: its own, then its buckets' others."""
        return list(dict.fromkeys([self.backend] + [b.backend for b in self.buckets if b.backend]))


@dataclass(frozen=True)
class TunedDefaults:
    deployment: str
    model: dict
    provenance: dict
    entries: tuple[TunedEntry, ...]
    schema_version: int = SCHEMA_VERSION
    source: str = field(default="<memory>", compare=False)

    def entries_for(self, tp: int) -> list[TunedEntry]:
        return sorted((e for e in self.entries if e.tp == tp), key=lambda e: e.max_batch)

    def lookup(self, tp: int, batch: int) -> TunedEntry | None:
        """The entry serving `batch` requests at `tp` (policy in the module docstring)."""
        cands = self.entries_for(tp)
        for e in cands:
            if batch <= e.max_batch:
                return e
        return cands[-1] if cands else None

    def to_dict(self) -> dict:
        return {
            "schema_version": self.schema_version,
            "deployment": self.deployment,
            "model": dict(self.model),
            "provenance": dict(self.provenance),
            "entries": [
                {"tp": e.tp, "heads_per_rank": e.heads_per_rank, "max_batch": e.max_batch, "backend": e.backend,
                 "params": dict(e.params),
                 "buckets": [{k: v for k, v in asdict(b).items() if v is not None} for b in e.buckets]}
                for e in self.entries
            ],
        }


def _err(src: str, key: str, msg: str) -> SchemaError:
    return SchemaError(f"{src}: {key}: {msg}")


def _int(src, key, v, lo=1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise _err(src, key, f"expected an int >= {lo}, got {v!r}")
    return v


def _opt_float(src, key, v, unit=" (microseconds)"):
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
        raise _err(src, key, f"expected a finite number >= 0{unit}, got {v!r}")
    return float(v)


def _mapping(src, key, v) -> dict:
    if not isinstance(v, dict):
        raise _err(src, key, f"expected a mapping, got {type(v).__name__}")
    return v


def check_keys(src, key, d, allowed, required=(), error: type[ValueError] = SchemaError) -> dict:
    """`d` itself, once it is a mapping with keys only from `allowed` and every key of
    `required`; else `error("<src>: <key>: ...")`. Shared with the tuner's config files
    (which pass their ConfigError)."""
    if d is None and key == "<top>":
        raise error(f"{src}: empty, or cut before its first key; expected a mapping with keys {list(allowed)}")
    if not isinstance(d, dict):
        raise error(f"{src}: {key}: expected a mapping, got {type(d).__name__}")
    unknown = sorted(set(d) - set(allowed), key=repr)   # YAML keys may mix str and int
    if unknown:
        raise error(f"{src}: {key}: unknown key(s) {unknown}; allowed: {list(allowed)}")
    missing = [k for k in required if k not in d]
    if missing:
        raise error(f"{src}: {key}: missing key(s) {missing}")
    return d


def _parse_head(src: str, data: Any) -> tuple[dict, dict, dict]:
    """The document's top level, `model` and `provenance`, checked (SchemaError naming the key)."""
    d = check_keys(src, "<top>", data, ("schema_version", "deployment", "model", "provenance", "entries"),
          ("schema_version", "deployment", "model", "provenance", "entries"))
    if type(d["schema_version"]) is not int or d["schema_version"] != SCHEMA_VERSION:   # not 1.0, not true
        raise _err(src, "schema_version", f"expected {SCHEMA_VERSION}, got {d['schema_version']!r}")
    if not isinstance(d["deployment"], str) or not d["deployment"]:
        raise _err(src, "deployment", f"expected a non-empty string, got {d['deployment']!r}")
    model = check_keys(src, "model", d["model"], MODEL_KEYS, MODEL_KEYS[1:])
    if "name" in model and not isinstance(model["name"], str):
        raise _err(src, "model.name", f"expected a string, got {model['name']!r}")
    for k in ("num_heads", "kv_lora_rank", "qk_rope_head_dim", "draft_tokens"):
        _int(src, f"model.{k}", model[k])
    if model["draft_tokens"] > MAX_DRAFT_TOKENS:
        raise _err(src, "model.draft_tokens", f"{model['draft_tokens']} exceeds {MAX_DRAFT_TOKENS} (one int64 "
                                              "tree-mask word per query row)")
    if _opt_float(src, "model.sm_scale", model["sm_scale"], "") is None or model["sm_scale"] <= 0:
        raise _err(src, "model.sm_scale", f"expected a positive number, got {model['sm_scale']!r}")
    prov = check_keys(src, "provenance", d["provenance"], PROVENANCE_KEYS,
                      ("device_name", "arch", "kernel_hash", "date"))
    if not isinstance(prov["arch"], str) or not (prov["arch"].startswith("sm_") or prov["arch"] == "cpu"):
        raise _err(src, "provenance.arch", f"expected e.g. 'sm_90' (or 'cpu'), got {prov['arch']!r}")
    for k in ("device_name", "date"):   # an unquoted date would load as a datetime
        if not isinstance(prov[k], str) or not prov[k]:
            raise _err(src, f"provenance.{k}", f"expected a non-empty (quoted) string, got {prov[k]!r}")
    for name, h in _mapping(src, "provenance.kernel_hash", prov["kernel_hash"]).items():
        if not isinstance(h, str) or not h:
            raise _err(src, f"provenance.kernel_hash.{name}", f"expected the source hash as a string, got {h!r}")
    return d, model, prov


def parse_tuned(data: Any, source: str = "<memory>", check_params: bool = True,
                legacy_names: bool = False) -> TunedDefaults:
    """Validate a parsed YAML document and build `TunedDefaults` (SchemaError on any problem).

    check_params: also build each entry's parameter dataclass (its declaration checks it).
    legacy_names: give parameters a backend has renamed (`backends.RENAMED_PARAMS`, e.g.
        Triton's BLOCK_H -> HEADS_PER_BLOCK) their current names, for reading committed
        evidence written before the rename. Off (serving): an old name is an error naming
        the current one.
    """
    src = source
    d, model, prov = _parse_head(src, data)
    entries_raw = d["entries"]
    if not isinstance(entries_raw, list) or not entries_raw:
        raise _err(src, "entries", "expected a non-empty list")
    entries = []
    seen = set()
    for i, e in enumerate(entries_raw):
        key = f"entries[{i}]"
        e = check_keys(src, key, e, ("tp", "heads_per_rank", "max_batch", "backend", "params", "buckets"),
              ("tp", "heads_per_rank", "max_batch", "backend", "params", "buckets"))
        tp = _int(src, f"{key}.tp", e["tp"])
        hpr = _int(src, f"{key}.heads_per_rank", e["heads_per_rank"])
        if model["num_heads"] != hpr * tp:
            raise _err(src, f"{key}.heads_per_rank", f"{hpr} x tp {tp} != model.num_heads {model['num_heads']}")
        mb = _int(src, f"{key}.max_batch", e["max_batch"])
        if (tp, mb) in seen:
            raise _err(src, key, f"duplicate entry for tp={tp}, max_batch={mb}")
        seen.add((tp, mb))
        if e["backend"] not in BACKEND_NAMES:
            raise _err(src, f"{key}.backend", f"expected one of {list(BACKEND_NAMES)}, got {e['backend']!r}")
        params = _mapping(src, f"{key}.params", e["params"])
        if check_params and e["backend"] == "reference" and params:
            raise _err(src, f"{key}.params", f"backend 'reference' takes no parameters, got {sorted(params)}")
        if legacy_names:
            from .backends import rename_legacy_params
            params = rename_legacy_params(e["backend"], params)
        if check_params and e["backend"] != "reference":
            from .backends import params_from_dict
            from .params import params_type
            try:
                params_from_dict(params_type(e["backend"]), params, where=f"{src}: {key}.params", complete=True)
            except ValueError as exc:
                raise SchemaError(str(exc) if str(exc).startswith(src) else f"{src}: {key}.params: {exc}") from None
        entry = TunedEntry(tp, hpr, mb, e["backend"], dict(params),
                           _parse_buckets(src, key, e["buckets"], params, e["backend"]))
        if check_params and e["backend"] != "reference":
            from .backends import params_from_dict
            from .params import params_type
            for be, cp, ns in entry.configs()[1:]:
                at = ",".join(str(i) for i, n in enumerate(ns) if n)   # the buckets this config serves
                try:
                    where = f"{src}: {key}.buckets[{at}].params"
                    params_from_dict(params_type(be), cp, where=where, complete=True)
                except ValueError as exc:
                    raise SchemaError(str(exc) if str(exc).startswith(src) else f"{where}: {exc}") from None
        entries.append(entry)
    return TunedDefaults(deployment=d["deployment"], model=dict(model), provenance=dict(prov),
                         entries=tuple(entries), source=src)


def _parse_buckets(src, key, braw, params: dict, backend: str) -> tuple[ContextBucket, ...]:
    """An entry's buckets: strictly increasing max_context, each NSPLIT within its config's grid
    (params.NSPLIT for the entry's own), its own params checked for shape (`_bucket_params`)."""
    if not isinstance(braw, list) or not braw:
        raise _err(src, f"{key}.buckets", "expected a non-empty list")
    grid_nsplit = params.get("NSPLIT")
    buckets = []
    prev = 0
    for j, b in enumerate(braw):
        bkey = f"{key}.buckets[{j}]"
        b = check_keys(src, bkey, b, ("max_context", "NSPLIT", "backend", "params") + _BUCKET_TIMES,
                       ("max_context", "NSPLIT"))
        mc = _int(src, f"{bkey}.max_context", b["max_context"])
        if mc <= prev:
            raise _err(src, f"{bkey}.max_context", f"buckets must increase strictly ({mc} after {prev})")
        prev = mc
        ns = _int(src, f"{bkey}.NSPLIT", b["NSPLIT"])
        other = _bucket_backend(src, bkey, b, backend)
        own = _bucket_params(src, bkey, b.get("params"), params, backend) if other is None else \
            _other_backend_params(src, bkey, b.get("params"), other)
        if own is None and grid_nsplit is not None and ns > grid_nsplit:
            raise _err(src, f"{bkey}.NSPLIT", f"{ns} exceeds params.NSPLIT={grid_nsplit} (the grid size)")
        times = {k: _opt_float(src, f"{bkey}.{k}", b.get(k)) for k in _BUCKET_TIMES}
        buckets.append(ContextBucket(mc, ns, **times, backend=other, params=own))
    if all(b.params is not None for b in buckets):
        raise _err(src, f"{key}.buckets", "every bucket names its own params: the entry's params serve none")
    return tuple(buckets)


def _bucket_params(src, bkey, raw, entry_params: dict, backend: str) -> dict | None:
    """A bucket's own compile-time parameters (a per-context dispatch), checked for shape: a
    mapping of the entry's parameter names but NSPLIT (a bucket's NSPLIT is its own key) that
    differs from the entry's. None when absent."""
    if raw is None:
        return None
    raw = _mapping(src, f"{bkey}.params", raw)
    bad = sorted(k for k in raw if k == "NSPLIT" or k not in entry_params)
    if bad or not raw:
        raise _err(src, f"{bkey}.params", f"expected compile-time parameters of the entry but NSPLIT, got "
                                          f"{sorted(raw)}{'' if raw else ' (empty)'}")
    from .params import nsplit_per_batch
    if not nsplit_per_batch(backend):
        raise _err(src, f"{bkey}.params", f"backend {backend} picks NSPLIT per request and cannot serve a bucket "
                                          "with other compile-time params")
    if all(entry_params[k] == v for k, v in raw.items()):
        raise _err(src, f"{bkey}.params", f"{raw} are the entry's own: leave them out")
    return dict(raw)


def _bucket_backend(src, bkey, b: dict, entry_backend: str) -> str | None:
    """A bucket's own backend (a per-context dispatch across kernels), checked: a backend name
    other than the entry's, both counting NSPLIT over the batch (an idle launch needs the split
    table's 0). None when absent."""
    if "backend" not in b:
        return None
    be = b["backend"]
    if be not in BACKEND_NAMES:
        raise _err(src, f"{bkey}.backend", f"expected one of {list(BACKEND_NAMES)}, got {be!r}")
    if be == entry_backend:
        raise _err(src, f"{bkey}.backend", f"{be} is the entry's own: leave it out")
    from .params import nsplit_per_batch
    for name in (entry_backend, be):
        if not nsplit_per_batch(name):
            raise _err(src, f"{bkey}.backend", f"backend {name} picks NSPLIT per request and cannot share an entry "
                                               "with another backend's buckets")
    if "params" not in b:
        raise _err(src, f"{bkey}.params", f"required with backend {be}: its compile-time parameters but NSPLIT")
    return be


def _other_backend_params(src, bkey, raw, backend: str) -> dict:
    """The compile-time parameters of a bucket on another backend: a mapping without NSPLIT
    (their completeness and values are checked against the backend's declaration with the entry)."""
    raw = _mapping(src, f"{bkey}.params", raw)
    if "NSPLIT" in raw:
        raise _err(src, f"{bkey}.params", f"NSPLIT is the bucket's own key, not one of backend {backend}'s params "
                                          "here")
    return dict(raw)


def load_tuned(path: str | os.PathLike, check_params: bool = True, legacy_names: bool = False) -> TunedDefaults:
    """Read and validate one exported YAML file (legacy_names: see `parse_tuned`)."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8-sig")   # a BOM (some Windows editors add one) is not text
    except OSError as e:
        raise SchemaError(f"{path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise SchemaError(f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); "
                          "save the file as UTF-8") from None
    if text.startswith(EXPORT_HEADER) and text.rstrip().rsplit("\n", 1)[-1] != EXPORT_TRAILER:
        lines = text.split("\n")
        if EXPORT_TRAILER in lines:
            raise SchemaError(f"{path}: line {lines.index(EXPORT_TRAILER) + 1} is the end marker "
                              f"{EXPORT_TRAILER!r}, but text follows it; an exported file ends there (put "
                              "notes above it, or in another file)")
        raise SchemaError(f"{path}: cut short: an exported file ends with the line {EXPORT_TRAILER!r}, and "
                          "this one does not (copy it again, or export again)")
    try:
        data = yaml_load(text)
    except yaml.YAMLError as e:
        raise SchemaError(f"{path}: not valid YAML: {e}") from None
    return parse_tuned(data, str(path), check_params, legacy_names)


def dump_tuned(tuned: TunedDefaults, path: str | os.PathLike) -> Path:
    """Validate and write `tuned` to `path` (atomically: write then rename)."""
    parse_tuned(tuned.to_dict(), str(path), check_params=True)
    path = Path(path)
    if path.is_dir():
        raise SchemaError(f"{path}: is a folder; name the YAML file to write")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    body = yaml.safe_dump(tuned.to_dict(), sort_keys=False, default_flow_style=None, width=110)
    tmp.write_text(f"{EXPORT_HEADER}\n{body}{EXPORT_TRAILER}\n")
    os.replace(tmp, path)
    return path
