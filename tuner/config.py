"""Deployments and device profiles: the YAML files under `configs/`.

A deployment names what is served (the model's MLA shape, the draft tree), where (a device
profile), and the grid the tuner covers: tp degrees x batch buckets x context buckets x
backends, with a trial budget per study and a workspace budget. A device profile holds the
arch limits and the measured ceilings (read bandwidth, bf16 MMA rate) that define the floor.

Loading is strict: unknown or missing keys and bad values raise `ConfigError` naming the
file and the key.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kvtune.kernels import tuned
from kvtune.kernels.shapes import MAX_DRAFT_TOKENS, ModelShape

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO_ROOT / "configs"
TREES = ("chain", "random")
TIMINGS = ("graph", "eager")
DEFAULT_WORKSPACE_BUDGET_MB = 256


class ConfigError(ValueError):
    """A deployment, device or search-space file is wrong; the message names file and key."""


def _err(src, key, msg) -> ConfigError:
    return ConfigError(f"{src}: {key}: {msg}")


def redact_url(url: str | None) -> str | None:
    """`url` with its password hidden (`***`), for everything printed or recorded: a storage
    URL ends up in logs and in the committed `runs.jsonl`."""
    if not url or "://" not in url or "@" not in url:
        return url
    try:
        from sqlalchemy.engine import make_url
        u = make_url(url)
        if u.password is None:
            return url
        return u.render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - not an SQLAlchemy URL: hide whatever sits between ':' and '@'
        return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)


def redact_argv(argv: list[str]) -> list[str]:
    """A command line with every URL's password hidden (`--storage URL` and `--storage=URL`)."""
    out = []
    for a in argv:
        flag, eq, val = a.partition("=")
        out.append(f"{flag}={redact_url(val)}" if eq and flag.startswith("--") else redact_url(a))
    return out


def read_yaml(path: Path) -> Any:
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); "
                          "save the file as UTF-8") from None
    try:
        return tuned.yaml_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None


def check_keys(src, key, d, allowed, required=()) -> dict:
    return tuned.check_keys(src, key, d, allowed, required, error=ConfigError)


def pos_int(src, key, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise _err(src, key, f"expected a positive int, got {v!r}")
    return v


def pos_float(src, key, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
        raise _err(src, key, f"expected a finite positive number, got {v!r}")
    return float(v)


def int_list(src, key, v, increasing=True) -> tuple[int, ...]:
    if isinstance(v, int) and not isinstance(v, bool):
        v = [v]
    if not isinstance(v, list) or not v:
        raise _err(src, key, f"expected a non-empty list of positive ints, got {v!r}")
    out = tuple(pos_int(src, f"{key}[{i}]", x) for i, x in enumerate(v))
    if increasing and any(b <= a for a, b in zip(out, out[1:])):
        raise _err(src, key, f"values must increase strictly, got {list(out)}")
    return out


# --------------------------------------------------------------------------- devices
@dataclass(frozen=True)
class DeviceProfile:
    """Arch limits and measured ceilings of one GPU model (or the CPU)."""

    name: str
    device_name: str
    arch: str                   # "sm_90", "sm_120", ... or "cpu"
    sm_count: int
    l2_bytes: int
    smem_per_block_bytes: int
    smem_per_sm_bytes: int
    regs_per_sm: int
    threads_per_sm: int
    read_gbps: float            # measured: large read-only reduction
    bf16_tflops: float          # measured: large bf16 matrix product
    ceilings_source: str = ""
    source: str = field(default="<memory>", compare=False)

    @property
    def is_cpu(self) -> bool:
        return self.arch == "cpu"

    def to_dict(self) -> dict:
        """The profile as its YAML file holds it (`limits` only for an arch without an
        ARCH_LIMITS entry)."""
        out = {"name": self.name, "device_name": self.device_name, "arch": self.arch, "sm_count": self.sm_count,
               "l2_bytes": self.l2_bytes,
               "limits": {"smem_per_block_bytes": self.smem_per_block_bytes,
                          "smem_per_sm_bytes": self.smem_per_sm_bytes, "regs_per_sm": self.regs_per_sm,
                          "threads_per_sm": self.threads_per_sm},
               "ceilings": {"read_gbps": self.read_gbps, "bf16_tflops": self.bf16_tflops,
                            "source": self.ceilings_source}}
        if _arch_table(self.arch) is not None:
            del out["limits"]
        return out


_DEVICE_KEYS = ("name", "device_name", "arch", "sm_count", "l2_bytes", "limits", "ceilings")
_LIMIT_KEYS = ("smem_per_block_bytes", "smem_per_sm_bytes", "regs_per_sm", "threads_per_sm")


def _arch_table(arch: str) -> dict | None:
    """The limits of `arch` in the CUDA kernel's table (ARCH_LIMITS), under the profile's keys."""
    from kvtune.kernels.cuda.params import ARCH_LIMITS
    a = ARCH_LIMITS.get(arch)
    return None if a is None else {"smem_per_block_bytes": a.smem_per_block, "smem_per_sm_bytes": a.smem_per_sm,
                                   "regs_per_sm": a.regs_per_sm, "threads_per_sm": a.threads_per_sm}


def _limits(src, d) -> dict:
    """A profile's `limits`: an arch in ARCH_LIMITS takes that table's (one declaration, which
    compile-check and static_reject judge by; a `limits` block given must agree with it);
    any other arch (the CPU) gives its own."""
    table = _arch_table(d["arch"])
    if "limits" not in d:
        if table is None:
            raise _err(src, "limits", f"required for arch {d['arch']!r}, which kernels/cuda/params.py's "
                                      "ARCH_LIMITS does not list")
        return table
    lim = check_keys(src, "limits", d["limits"], _LIMIT_KEYS, _LIMIT_KEYS)
    for k in _LIMIT_KEYS if table is not None else ():
        if lim[k] != table[k]:
            raise _err(src, f"limits.{k}", f"{lim[k]!r} disagrees with ARCH_LIMITS[{d['arch']!r}] ({table[k]}) in "
                                           "kernels/cuda/params.py; leave `limits` out to take the table's")
    return lim


def parse_device(d: Any, src: str) -> DeviceProfile:
    check_keys(src, "<top>", d, _DEVICE_KEYS, [k for k in _DEVICE_KEYS if k != "limits"])
    for k in ("name", "device_name", "arch"):
        if not isinstance(d[k], str) or not d[k]:
            raise _err(src, k, f"expected a non-empty string, got {d[k]!r}")
    if not (d["arch"].startswith("sm_") or d["arch"] == "cpu"):
        raise _err(src, "arch", f"expected e.g. 'sm_90' or 'cpu', got {d['arch']!r}")
    lim = _limits(src, d)
    ceil = check_keys(src, "ceilings", d["ceilings"], ("read_gbps", "bf16_tflops", "source"),
                      ("read_gbps", "bf16_tflops"))
    return DeviceProfile(
        name=d["name"], device_name=d["device_name"], arch=d["arch"], sm_count=pos_int(src, "sm_count", d["sm_count"]),
        l2_bytes=pos_int(src, "l2_bytes", d["l2_bytes"]),
        **{k: pos_int(src, f"limits.{k}", lim[k]) for k in _LIMIT_KEYS},
        read_gbps=pos_float(src, "ceilings.read_gbps", ceil["read_gbps"]),
        bf16_tflops=pos_float(src, "ceilings.bf16_tflops", ceil["bf16_tflops"]),
        ceilings_source=str(ceil.get("source", "")), source=src)


def load_device(name_or_path: str | Path, near: Path | None = None) -> DeviceProfile:
    """A device profile by path, or by name from `near/../devices/` or `configs/devices/`."""
    p = Path(name_or_path)
    cands = [p] if p.suffix in (".yaml", ".yml") else []
    if near is not None:
        cands.append(near.parent.parent / "devices" / f"{name_or_path}.yaml")
    cands.append(CONFIG_DIR / "devices" / f"{name_or_path}.yaml")
    for c in cands:
        if c.is_file():
            return parse_device(read_yaml(c), str(c))
    raise ConfigError(f"device profile {str(name_or_path)!r} not found (looked at {[str(c) for c in cands]})")


# --------------------------------------------------------------------------- deployments
@dataclass(frozen=True)
class Deployment:
    """What one tuning run covers. Context buckets are prefix lengths (the bucket's upper
    bound, measured at the bound); batch buckets are batch sizes (measured at the bound)."""

    name: str
    model_name: str
    model: ModelShape
    tree: str
    device: DeviceProfile
    tp: tuple[int, ...]
    contexts: tuple[int, ...]
    batches: tuple[int, ...]
    backends: tuple[str, ...]
    trials: int
    workspace_budget_bytes: int
    timing: str = "graph"
    # batch buckets > 1 are also scored on a ragged batch of this max/min prefix ratio
    # (`tuner.measure.ragged_prefixes`, `tuner/ragged.py`); 1 turns that off
    ragged_spread: float = 8.0
    # search-space folder for this deployment's hardware (None: the repository's search_spaces/)
    space_dir: str | None = None
    source: str = field(default="<memory>", compare=False)

    def heads(self, tp: int) -> int:
        return self.model.heads_per_rank(tp)


_DEP_KEYS = ("name", "model", "device", "tp", "contexts", "batches", "backends", "trials", "workspace_budget_mb",
             "timing", "search_spaces", "description", "ragged_spread")
_DEP_REQUIRED = ("name", "model", "device", "tp", "contexts", "batches", "backends", "trials")
_MODEL_KEYS = ("name", "num_heads", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "sm_scale",
               "draft_tokens", "tree")


def _backends(be: Any, src: str) -> list[str]:
    """The deployment's `backends`: a name or a non-empty list of distinct names, not the oracle."""
    if isinstance(be, str):
        be = [be]
    if not isinstance(be, list) or not be or not all(isinstance(x, str) and x for x in be):
        raise _err(src, "backends", f"expected a non-empty list of backend names, got {be!r}")
    if len(set(be)) != len(be):
        raise _err(src, "backends", f"duplicate backend in {be}")
    if "reference" in be:
        raise _err(src, "backends", "'reference' is the oracle, not a tunable backend")
    return be


def _space_dir(sp: Any, src: str, path: Path | None) -> str:
    """`search_spaces`: a folder name under search_spaces/ (or beside the deployment file), or a path."""
    if not isinstance(sp, str) or not sp:
        raise _err(src, "search_spaces", f"expected a folder name or path, got {sp!r}")
    cands = [Path(sp), Path(__file__).resolve().parent.parent / "search_spaces" / sp]
    if path is not None:
        cands.insert(0, path.parent / sp)
    found = next((c for c in cands if c.is_dir()), None)
    if found is None:
        raise _err(src, "search_spaces", f"no folder {sp!r} (looked in {', '.join(str(c) for c in cands)})")
    return str(found)


def parse_deployment(d: Any, src: str, path: Path | None = None) -> Deployment:
    check_keys(src, "<top>", d, _DEP_KEYS, _DEP_REQUIRED)
    name = d["name"]
    if not isinstance(name, str) or not name or name in (".", "..") or any(c in name for c in "/\\ |"):
        raise _err(src, "name", f"expected a file-name-safe non-empty string, got {name!r}")
    m = check_keys(src, "model", d["model"], _MODEL_KEYS, ("name", "num_heads", "draft_tokens"))
    if not isinstance(m["name"], str) or not m["name"]:
        raise _err(src, "model.name", f"expected a non-empty string, got {m['name']!r}")
    ints = {}
    for k in ("num_heads", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "draft_tokens"):
        if k in m:
            ints[k] = pos_int(src, f"model.{k}", m[k])
    if ints["draft_tokens"] > MAX_DRAFT_TOKENS:
        raise _err(src, "model.draft_tokens", f"must be <= {MAX_DRAFT_TOKENS}, got {ints['draft_tokens']}")
    sm_scale = pos_float(src, "model.sm_scale", m["sm_scale"]) if m.get("sm_scale") is not None else None
    try:
        model = ModelShape(sm_scale=sm_scale, **ints)
    except ValueError as e:
        raise _err(src, "model", str(e)) from None
    tree = m.get("tree", "chain")
    if tree not in TREES:
        raise _err(src, "model.tree", f"expected one of {list(TREES)}, got {tree!r}")
    if not isinstance(d["device"], str):
        raise _err(src, "device", f"expected a device profile name or path, got {d['device']!r}")
    try:
        device = load_device(d["device"], near=path)
    except ConfigError as e:
        raise _err(src, "device", str(e)) from None
    tp = int_list(src, "tp", d["tp"])
    for i, t in enumerate(tp):
        if model.num_heads % t:
            raise _err(src, f"tp[{i}]", f"tp={t} does not divide model.num_heads={model.num_heads}")
    contexts = int_list(src, "contexts", d["contexts"])
    batches = int_list(src, "batches", d["batches"])
    be = _backends(d["backends"], src)
    trials = pos_int(src, "trials", d["trials"])
    budget_mb = pos_float(src, "workspace_budget_mb", d.get("workspace_budget_mb", DEFAULT_WORKSPACE_BUDGET_MB))
    timing = d.get("timing", "graph")
    if timing not in TIMINGS:
        raise _err(src, "timing", f"expected one of {list(TIMINGS)}, got {timing!r}")
    space_dir = _space_dir(d["search_spaces"], src, path) if "search_spaces" in d else None
    spread = pos_float(src, "ragged_spread", d.get("ragged_spread", Deployment.ragged_spread))
    if spread < 1:
        raise _err(src, "ragged_spread", f"the ragged batch's max/min prefix ratio must be >= 1 (1: no ragged "
                                         f"scoring), got {spread}")
    return Deployment(name=name, model_name=m["name"], model=model, tree=tree, device=device, tp=tp,
                      contexts=contexts, batches=batches, backends=tuple(be), trials=trials,
                      workspace_budget_bytes=int(budget_mb * 2**20), timing=timing, space_dir=space_dir,
                      ragged_spread=spread, source=src)


def find_deployment(name_or_path: str | Path) -> Path:
    """A deployment file by path, or by name from `configs/deployments/`."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    if p.suffix in (".yaml", ".yml") or len(p.parts) > 1:   # a path, not a shipped deployment's name
        raise ConfigError(f"deployment {str(name_or_path)!r}: {'a folder' if p.is_dir() else 'no such file'}")
    shipped = CONFIG_DIR / "deployments"
    cand = shipped / f"{name_or_path}.yaml"
    if cand.is_file():
        return cand
    names = ", ".join(sorted(f.stem for f in shipped.glob("*.yaml")))
    raise ConfigError(f"deployment {str(name_or_path)!r} not found (neither a file nor a deployment of {shipped}: "
                      f"{names})")


def load_deployment(name_or_path: str | Path) -> Deployment:
    path = find_deployment(name_or_path)
    return parse_deployment(read_yaml(path), str(path), path)
