"""Search spaces: `search_spaces/<backend>.yaml`, one per backend, each narrowing the
backend's parameter declaration (`kvtune.kernels.params`, declared beside its kernel) for a
class of hardware.

    backend: triton
    params:                       # every declared parameter: the values this space tries
      NSPLIT:   {choices: [1, 2, 4, 8, 16, 32, 64]}
      BLOCK_N:  {range: {low: 16, high: 128, step: 16}}
    constraints:                  # expressions over params and the problem; False = pruned
      - {name: no_empty_splits, expr: "NSPLIT <= cdiv(keys, BLOCK_N)", reason: "..."}

A value outside the declaration's legal values is an error naming the file and the key. The
declaration's rules (the kernel's static_asserts) are constraints of every space; a file adds
its own. Names a constraint may use: the parameters, the problem (`T`, `H`, `B`, `context` =
prefix tokens, `keys` = context + T, `Dk`, `Dv`), the device (`sm_count`, `smem_per_block`,
`smem_per_sm`, `regs_per_sm`, `threads_per_sm`), integers, arithmetic, comparisons,
`and`/`or`/`not`, and the functions `min`, `max`, `cdiv`, `next_pow2`, `log2`.
Unknown or missing parameters, and unknown names in a constraint, are errors naming the
file and the key.

`load_space` is the one reader: the sweep, the workers, replay and compile-check take their
spaces from it.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtune.kernels.backends import renamed_hint
from kvtune.kernels.params import Declaration, Expr, declaration

from .config import REPO_ROOT, ConfigError, check_keys, read_yaml

SPACE_DIR = REPO_ROOT / "search_spaces"
PROBLEM_NAMES = ("T", "H", "B", "context", "keys", "Dk", "Dv")
DEVICE_NAMES = ("sm_count", "smem_per_block", "smem_per_sm", "regs_per_sm", "threads_per_sm")
#: how the reason of every config pruned by a space's constraint begins (`SearchSpace.violation`)
CONSTRAINT_PREFIX = "constraint "


@dataclass(frozen=True)
class Constraint:
    name: str
    expr: Expr
    reason: str


@dataclass(frozen=True)
class SearchSpace:
    """The choices of every parameter of one backend, and the constraints among them."""

    backend: str
    choices: dict          # name -> tuple of values, in the dataclass's field order
    constraints: tuple
    source: str

    @property
    def names(self) -> list[str]:
        return list(self.choices)

    def violation(self, params: dict, env: dict) -> str | None:
        """The first constraint `params` breaks on this problem/device, as a reason, or None."""
        scope = dict(env)
        scope.update(params)
        for c in self.constraints:
            try:
                ok = bool(c.expr(scope))
            except Exception as e:  # noqa: BLE001 - a constraint that cannot evaluate is a broken file
                raise ConfigError(f"{self.source}: constraints.{c.name}: cannot evaluate {c.expr.text!r} "
                                  f"for {params}: {e}") from None
            if not ok:
                why = f"{CONSTRAINT_PREFIX}{c.name} ({c.expr.text}) broken"
                return f"{why}: {c.reason}" if c.reason else why
        return None

    def distributions(self, extra: dict | None = None) -> dict:
        """Choices per parameter, widened by the values in `extra` (the backend's default for
        this problem, which must be a legal point of every study)."""
        out = {}
        for n, vals in self.choices.items():
            vals = list(vals)
            if extra is not None and extra.get(n) not in vals:
                vals = sorted(vals + [extra[n]])
            out[n] = tuple(vals)
        return out

    def size(self, extra: dict | None = None) -> int:
        """How many points `grid(extra)` has, without listing them."""
        return math.prod(len(v) for v in self.distributions(extra).values())

    def grid(self, extra: dict | None = None) -> list[dict]:
        """Every combination of the choices (widened by `extra`, as `distributions`), in the
        declaration's parameter order, the last parameter varying fastest; constraints not
        applied."""
        dists = self.distributions(extra)
        return [dict(zip(dists, vals)) for vals in itertools.product(*dists.values())]


def _choices(src: str, key: str, spec: Any) -> tuple:
    if isinstance(spec, list):
        spec = {"choices": spec}
    check_keys(src, key, spec, ("choices", "range"))
    if ("choices" in spec) == ("range" in spec):
        raise ConfigError(f"{src}: {key}: give exactly one of 'choices' or 'range'")
    if "choices" in spec:
        vals = spec["choices"]
        if not isinstance(vals, list) or not vals:
            raise ConfigError(f"{src}: {key}.choices: expected a non-empty list, got {vals!r}")
        for i, v in enumerate(vals):
            if isinstance(v, bool) or not isinstance(v, (int, float, str)):
                raise ConfigError(f"{src}: {key}.choices[{i}]: expected a number or string, got {v!r}")
        if len(set(vals)) != len(vals):
            raise ConfigError(f"{src}: {key}.choices: duplicate values in {vals}")
        return tuple(vals)
    r = check_keys(src, f"{key}.range", spec["range"], ("low", "high", "step", "log"), ("low", "high"))
    low, high, step, log = r["low"], r["high"], r.get("step", 1), bool(r.get("log", False))
    for k, v in (("low", low), ("high", high), ("step", step)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{src}: {key}.range.{k}: expected an int, got {v!r}")
    if high < low or step < 1 or (log and low < 1):
        raise ConfigError(f"{src}: {key}.range: need 1 <= step, low <= high (and low >= 1 with log), got {r}")
    if log:  # powers of two from low to high
        vals, v = [], low
        while v <= high:
            vals.append(v)
            v *= 2
        return tuple(vals)
    return tuple(range(low, high + 1, step))


def _narrowed(src: str, key: str, vals: tuple, decl: Declaration, name: str, ranged: bool) -> tuple:
    """`vals` once each is one of the declaration's legal values for `name`."""
    p = decl.params[name]
    for i, v in enumerate(vals):
        why = p.violation(v)
        if why:
            at = f"{key}.range" if ranged else f"{key}.choices[{i}]"
            raise ConfigError(f"{src}: {at}: {v!r} is outside the declaration of {decl.type_name}.{name} "
                              f"({why}); a search space may only narrow it")
    return vals


def parse_space(d: Any, src: str, backend: str, fields: list[str] | None = None) -> SearchSpace:
    """Validate a search-space document against `backend`'s parameter declaration.

    fields: the parameters the space must give, in order (default: every declared one); a
    replayed trials table may predate a parameter, and its space then leaves it out. The
    declaration's rules over parameters outside `fields` do not apply."""
    decl = declaration(backend)
    declared = decl.names
    if fields is not None:
        stray = [f for f in fields if f not in declared]
        if stray:
            raise ConfigError(f"{src}: backend {backend!r} reports parameter(s) {stray} that its declaration "
                              f"({decl.type_name}) lacks; declared: {declared}")
        declared = list(fields)
    check_keys(src, "<top>", d, ("backend", "params", "constraints", "description"), ("backend", "params"))
    if d["backend"] != backend:
        raise ConfigError(f"{src}: backend: file is for {d['backend']!r}, expected {backend!r}")
    params = d["params"]
    if not isinstance(params, dict) or not params:
        raise ConfigError(f"{src}: params: expected a mapping of parameter names to choices")
    unknown = sorted(set(params) - set(declared))
    if unknown and fields is not None and not set(unknown) - set(decl.names):
        raise ConfigError(f"{src}: params.{unknown[0]}: parameter(s) {unknown} of {decl.type_name} are not "
                          f"measured here; this space may only give {declared}")
    if unknown:
        raise ConfigError(f"{src}: params.{unknown[0]}: unknown parameter(s) {unknown} for backend {backend!r}; "
                          f"its parameters are {declared}{renamed_hint(unknown, declared)}")
    missing = [f for f in declared if f not in params]
    if missing:
        raise ConfigError(f"{src}: params: missing parameter(s) {missing} for backend {backend!r} "
                          "(every declared parameter needs choices)")
    choices = {}
    for f in declared:
        key = f"params.{f}"
        choices[f] = _narrowed(src, key, _choices(src, key, params[f]), decl, f,
                               ranged=isinstance(params[f], dict) and "range" in params[f])
    names = list(declared) + list(PROBLEM_NAMES) + list(DEVICE_NAMES)
    cons = []
    raw = d.get("constraints") or []
    if not isinstance(raw, list):
        raise ConfigError(f"{src}: constraints: expected a list")
    for i, c in enumerate(raw):
        key = f"constraints[{i}]"
        if isinstance(c, str):
            c = {"expr": c}
        check_keys(src, key, c, ("name", "expr", "reason"), ("expr",))
        if not isinstance(c["expr"], str):
            raise ConfigError(f"{src}: {key}.expr: expected a string, got {c['expr']!r}")
        cons.append(Constraint(str(c.get("name", f"c{i}")), Expr(c["expr"], names, f"{src}: {key}.expr",
                                                                  ConfigError), str(c.get("reason", ""))))
    # the kernel's own rules: a point that breaks one is pruned before it costs a compile
    cons += [Constraint(r.name, r.expr, f"{r.reason} ({decl.type_name})") for r in decl.rules
             if r.expr.names <= set(declared) | set(PROBLEM_NAMES)]
    return SearchSpace(backend, choices, tuple(cons), src)


def read_space(path: str | Path, backend: str | None = None) -> SearchSpace:
    """One search-space file (backend: the one it must be for; default: the one it names)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such search-space file")
    d = read_yaml(path)
    if backend is None:
        backend = d.get("backend") if isinstance(d, dict) else None
        if not isinstance(backend, str):
            raise ConfigError(f"{path}: backend: missing (the backend whose parameters the file narrows)")
    return parse_space(d, str(path), backend)


def load_space(backend: str, fields: list[str] | None = None, space_dir: str | Path | None = None) -> SearchSpace:
    """`<space_dir>/<backend>.yaml` (default: the repository's search_spaces/)."""
    path = Path(space_dir or SPACE_DIR) / f"{backend}.yaml"
    if not path.is_file():
        raise ConfigError(f"{path}: no search space for backend {backend!r}")
    return parse_space(read_yaml(path), str(path), backend, fields)


def problem_env(T: int, H: int, B: int, context: int, Dk: int, Dv: int, device) -> dict:
    """The names a constraint sees besides the parameters (device: a DeviceProfile)."""
    return {"T": T, "H": H, "B": B, "context": context, "keys": context + T, "Dk": Dk, "Dv": Dv,
            "sm_count": device.sm_count, "smem_per_block": device.smem_per_block_bytes,
            "smem_per_sm": device.smem_per_sm_bytes, "regs_per_sm": device.regs_per_sm,
            "threads_per_sm": device.threads_per_sm}
