"""Finding, loading and provenance-checking an exported defaults file (the serving runtime's
first step; `runtime.VerifyAttention.from_defaults` calls `load_defaults`).

Lookup (`find_defaults`): the folders of `KVTUNE_CONFIG_DIR` (os.pathsep-separated, first
wins) before the packaged `kvtune/kernels/defaults/`; in each folder, `<deployment>.yaml`
first, then `<model>__<device>.yaml` (both names slugged: characters other than
`A-Za-z0-9._-` become `_`, e.g. `Kimi-K2__NVIDIA_H200.yaml`). No file -> a warning logged
once and the backend's untuned default.

Never imports the tuner, Optuna or pandas: only torch, PyYAML and the kernels.
"""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Sequence

import torch

from .backends import get_backend
from .devices import device_arch, device_name, device_sm_count  # noqa: F401 (device_name re-exported)
from .tuned import BACKEND_NAMES, SchemaError, TunedDefaults, load_tuned

log = logging.getLogger("kvtune.runtime")

ENV_CONFIG_DIR = "KVTUNE_CONFIG_DIR"
ENV_VERIFY = "KVTUNE_VERIFY"
VERIFY_MODES = ("off", "auto") + BACKEND_NAMES


class ProvenanceError(ValueError):
    """A defaults file was tuned for another arch, kernel source or deployment."""


# -- warn once: serving loops call into here every step; a message per step is noise
_warned: set[str] = set()


def warn_once(key: str, msg: str, level: int = logging.WARNING) -> None:
    if key not in _warned:
        _warned.add(key)
        log.log(level, msg)


def reset_warn_once() -> None:
    """Forget which warnings were logged (tests)."""
    _warned.clear()


# -- environment -----------------------------------------------------------------------

def verify_mode() -> str:
    """`KVTUNE_VERIFY`, lower-cased; unset or empty means `auto`."""
    raw = os.environ.get(ENV_VERIFY, "").strip().lower() or "auto"
    if raw not in VERIFY_MODES:
        raise ValueError(f"{ENV_VERIFY}={os.environ.get(ENV_VERIFY)!r}: expected one of {list(VERIFY_MODES)}")
    return raw


def packaged_defaults_dir() -> Path:
    """The folder of defaults shipped with the package (`kvtune/kernels/defaults/`)."""
    return Path(__file__).resolve().parent / "defaults"


def config_dirs() -> list[Path]:
    """Folders searched for defaults, first wins: `KVTUNE_CONFIG_DIR` entries, then packaged.
    An entry that is not a folder is warned about (once): a typo there would otherwise serve
    the packaged file in place of the user's own, without a word."""
    user = [Path(p).expanduser() for p in os.environ.get(ENV_CONFIG_DIR, "").split(os.pathsep) if p.strip()]
    for p in user:
        if not p.is_dir():
            warn_once(f"config-dir:{p}", f"kvtune: {ENV_CONFIG_DIR} entry {str(p)!r} is not a folder; it is "
                      "skipped, and defaults are looked up in the other entries and the packaged folder")
    return user + [packaged_defaults_dir()]


def slug(name: str) -> str:
    """A file-name-safe form of a model, device or deployment name."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", str(name).strip()).strip("_")


def defaults_file_names(deployment: str | None = None, model: str | None = None,
                        device_name: str | None = None) -> list[str]:
    """Candidate file names, most specific first: `<deployment>.yaml`, `<model>__<device>.yaml`."""
    names = []
    if deployment:
        names.append(f"{slug(deployment)}.yaml")
    if model and device_name:
        names.append(f"{slug(model)}__{slug(device_name)}.yaml")
    return names


def find_defaults(deployment: str | None = None, *, model: str | None = None, device_name: str | None = None,
                  dirs: Sequence[str | os.PathLike] | None = None) -> Path | None:
    """The first existing defaults file for this deployment (or model + device), or None."""
    names = defaults_file_names(deployment, model, device_name)
    if not names:
        raise ValueError("find_defaults: give a deployment name, or both model and device_name")
    for d in (config_dirs() if dirs is None else [Path(p) for p in dirs]):
        for n in names:
            p = Path(d) / n
            if p.is_file():
                return p
    return None


# -- provenance ------------------------------------------------------------------------

def resolve_device(device: torch.device | str | None) -> torch.device:
    """`device` as a torch.device (None: the current CUDA device, else the CPU); ValueError naming
    `device` for a spelling torch does not know, or a CUDA device this process cannot use."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device: {device!r} is not a device torch knows ({e})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: {device!r}, but torch sees no CUDA device here (torch "
                             f"{torch.__version__}, torch.cuda.is_available() is False)")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        elif not 0 <= dev.index < torch.cuda.device_count():
            raise ValueError(f"device: {device!r}, but this process sees {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
        raise ValueError(f"device: {device!r}; kvtune runs on 'cuda' (or 'cuda:N') and 'cpu'")
    return dev


def backend_kernel_hash(name: str) -> str | None:
    """The running kernel source hash of backend `name` (None for the oracle). Raises
    ValueError when the backend cannot be imported."""
    try:
        be = get_backend(name)
    except ImportError as e:
        raise ValueError(f"backend {name!r} cannot be imported: {e}") from None
    return be.kernel_hash()


def kernel_hash_mismatches(tuned: TunedDefaults) -> list[str]:
    """Each backend `tuned` serves (per-bucket ones too) that was measured on another kernel
    source than this checkout's, has no recorded hash or cannot be imported: one line each, naming
    the file and the key. Needs no GPU."""
    src = tuned.source
    out = []
    hashes = tuned.provenance.get("kernel_hash") or {}
    for name in sorted({be for e in tuned.entries for be in e.backends()}):
        try:
            running = backend_kernel_hash(name)
        except ValueError as e:
            out.append(f"{src}: entries: backend {name!r} is unavailable here ({e})")
            continue
        if running is None:
            if get_backend(name).params_type is not None:  # the oracle has nothing to match
                warn_once(f"nohash:{name}", f"kvtune: backend {name!r} exposes no kernel_source_hash(); "
                           f"{src}'s kernel_hash.{name} cannot be checked")
            continue
        recorded = hashes.get(name)
        if recorded is None:
            out.append(f"{src}: provenance.kernel_hash.{name}: missing (entries use backend {name!r})")
        elif recorded != running:
            out.append(f"{src}: provenance.kernel_hash.{name}: tuned against kernel source {recorded!r}, "
                       f"running {running!r}")
    return out


def provenance_mismatches(tuned: TunedDefaults, device: torch.device | str,
                          deployment: str | None = None, model: str | None = None) -> list[str]:
    """What differs between where `tuned` was measured and what runs here, one line each,
    naming the file and the key. Empty when everything matches. `model`: the model asked for
    (its name compared slugged, as a file name spells it)."""
    src = tuned.source
    out = []
    want_arch = device_arch(device)
    if tuned.provenance.get("arch") != want_arch:
        out.append(f"{src}: provenance.arch: tuned on {tuned.provenance.get('arch')!r}, "
                   f"this device is {want_arch!r}")
    out += kernel_hash_mismatches(tuned)
    if deployment is not None and tuned.deployment != deployment:
        out.append(f"{src}: deployment: file is for {tuned.deployment!r}, asked for {deployment!r}")
    if model is not None and slug(tuned.model.get("name", "")) != slug(model):
        out.append(f"{src}: model.name: file is for {tuned.model.get('name')!r}, asked for {model!r}")
    return out


def check_provenance(tuned: TunedDefaults, device: torch.device | str, *, deployment: str | None = None,
                     model: str | None = None, allow_mismatch: bool = False) -> list[str]:
    """Raise ProvenanceError on any mismatch, or (allow_mismatch) log each once and return them."""
    bad = provenance_mismatches(tuned, device, deployment, model)
    if bad and not allow_mismatch:
        raise ProvenanceError("tuned defaults do not match this machine (pass allow_mismatch=True to use them "
                              "anyway):\n  " + "\n  ".join(bad))
    for line in bad:
        warn_once(f"prov:{line}", f"kvtune: using mismatched tuned defaults: {line}")
    rec, have = tuned.provenance.get("sm_count"), device_sm_count(device)
    if isinstance(rec, int) and have is not None and rec != have:
        # legal (the arch and kernels match), but NSPLIT was sized for the tuning GPU's SMs: a
        # split count over this GPU's SM count runs a second wave of CTAs
        warn_once(f"sms:{tuned.source}:{have}", f"kvtune: {tuned.source} was tuned on a GPU of {rec} SMs "
                  f"({tuned.provenance.get('device_name')}), this one has {have}: its NSPLIT values may run "
                  "a second wave here; tune this GPU (`kvtune calibrate --deployment-for <family>`, then "
                  "`kvtune sweep` of the deployment it prints)")
    elif not bad and tuned.provenance.get("device_name") not in (None, device_name(device)):
        # same arch and kernel, other SKU (H100 vs H200): legal, but the tuning may not be optimal
        warn_once(f"sku:{tuned.source}", f"kvtune: {tuned.source} was tuned on "
                   f"{tuned.provenance.get('device_name')!r}, running on {device_name(device)!r}",
                   logging.INFO)
    return bad


def load_defaults(path: str | os.PathLike | None = None, *, deployment: str | None = None,
                  model: str | None = None, device: torch.device | str | None = None,
                  allow_mismatch: bool = False) -> TunedDefaults | None:
    """Find, validate and provenance-check an exported defaults file.

    path: a YAML file (loaded as is), a folder (searched for `<deployment>.yaml`, then
        `<model>__<device>.yaml`) or None (search `config_dirs()`).
    deployment: the deployment name; checked against the file's `deployment` key, unless the
        file was found by its `<model>__<device>.yaml` name (a file of the same model and
        device, tuned under another deployment's name).
    model: the model name (`model.name` of the export, e.g. "Kimi-K2"): looked up by that
        second name, and checked against the file's `model.name` when given.
    device: the device the kernel will run on (default: the current CUDA device, else cpu).
    allow_mismatch: use a file tuned for another arch / kernel source / deployment, logging
        each difference once, instead of raising ProvenanceError.

    Returns None (after logging once) when no file matches; raises SchemaError for a file
    that breaks the schema (the message names the file and the key).
    """
    device = resolve_device(device)
    by_model = False   # found by its `<model>__<device>.yaml` name: tuned under any deployment's name
    if path is not None and Path(path).is_file():
        found = Path(path)
    elif path is not None and not Path(path).exists():
        raise SchemaError(f"{path}: no such file or folder")
    else:
        dirs = None if path is None else [path]
        if not deployment and not model:
            raise ValueError(f"deployment: name the deployment (or the model) to look up tuned defaults in "
                             f"{[str(d) for d in (config_dirs() if dirs is None else dirs)]}, or pass a file")
        found = find_defaults(deployment, model=model, device_name=device_name(device), dirs=dirs)
        if found is None:
            where = [str(d) for d in (config_dirs() if dirs is None else dirs)]
            names = defaults_file_names(deployment, model, device_name(device))
            warn_once(f"nofile:{names}:{where}", f"kvtune: no tuned defaults {names} in {where}; "
                       "falling back to the backend's untuned default parameters")
            return None
        by_model = found.name not in defaults_file_names(deployment)
    tuned = load_tuned(found)
    check_provenance(tuned, device, deployment=None if by_model else deployment, model=model,
                     allow_mismatch=allow_mismatch)
    return tuned
