"""Search spaces: `search_spaces/<backend>.yaml`, one per backend.

    backend: triton
    params:                       # every field of the backend's parameter dataclass
      NSPLIT:   {choices: [1, 2, 4, 8, 16, 32, 64]}
      BLOCK_N:  {range: {low: 16, high: 128, step: 16}}
    constraints:                  # expressions over params and the problem; False = pruned
      - {name: no_empty_splits, expr: "NSPLIT <= cdiv(keys, BLOCK_N)", reason: "..."}

Names a constraint may use: the parameters, the problem (`T`, `H`, `B`, `context` = prefix
tokens, `keys` = context + T, `Dk`, `Dv`), the device (`sm_count`, `smem_per_block`,
`smem_per_sm`, `regs_per_sm`, `threads_per_sm`), integers, arithmetic, comparisons,
`and`/`or`/`not`, and the functions `min`, `max`, `cdiv`, `next_pow2`, `log2`.
Unknown or missing parameters, and unknown names in a constraint, are errors naming the
file and the key.
"""
from __future__ import annotations

import ast
import itertools
import math
import operator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from kvtune.kernels.backends import renamed_hint

from .config import REPO_ROOT, ConfigError, check_keys, read_yaml

SPACE_DIR = REPO_ROOT / "search_spaces"
PROBLEM_NAMES = ("T", "H", "B", "context", "keys", "Dk", "Dv")
DEVICE_NAMES = ("sm_count", "smem_per_block", "smem_per_sm", "regs_per_sm", "threads_per_sm")
FUNCS = {"min": min, "max": max, "cdiv": lambda a, b: -(-a // b),
         "next_pow2": lambda x: 1 << max(0, (int(x) - 1).bit_length()), "log2": lambda x: int(math.log2(x))}
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
           ast.Mod: operator.mod, ast.Div: operator.truediv, ast.Pow: operator.pow}
_CMPOPS = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
           ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.In: lambda a, b: a in b,
           ast.NotIn: lambda a, b: a not in b}


class Expr:
    """A small, safe arithmetic/boolean expression (no attribute access, no calls but FUNCS)."""

    def __init__(self, text: str, allowed: Iterable[str], where: str):
        self.text = text
        try:
            self.tree = ast.parse(text, mode="eval").body
        except SyntaxError as e:
            raise ConfigError(f"{where}: cannot parse {text!r}: {e.msg}") from None
        allowed = set(allowed)
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Name) and node.id not in allowed and node.id not in FUNCS:
                raise ConfigError(f"{where}: unknown name {node.id!r} in {text!r}; known: "
                                  f"{sorted(allowed)} and functions {sorted(FUNCS)}")
            if not isinstance(node, (ast.Expression, ast.BoolOp, ast.BinOp, ast.UnaryOp, ast.Compare, ast.Call,
                                     ast.Name, ast.Constant, ast.Load, ast.And, ast.Or, ast.Not, ast.USub,
                                     ast.Tuple, ast.List, *_BINOPS, *_CMPOPS)):
                raise ConfigError(f"{where}: {type(node).__name__} is not allowed in {text!r}")
            if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id in FUNCS):
                raise ConfigError(f"{where}: only {sorted(FUNCS)} may be called in {text!r}")

    def __call__(self, env: dict) -> Any:
        return self._eval(self.tree, env)

    def _eval(self, n, env):
        if isinstance(n, ast.Constant):
            return n.value
        if isinstance(n, ast.Name):
            return env[n.id] if n.id in env else FUNCS[n.id]
        if isinstance(n, ast.BinOp):
            return _BINOPS[type(n.op)](self._eval(n.left, env), self._eval(n.right, env))
        if isinstance(n, ast.UnaryOp):
            v = self._eval(n.operand, env)
            return (not v) if isinstance(n.op, ast.Not) else -v
        if isinstance(n, ast.BoolOp):
            vals = (self._eval(v, env) for v in n.values)
            return all(vals) if isinstance(n.op, ast.And) else any(vals)
        if isinstance(n, ast.Compare):
            left = self._eval(n.left, env)
            for op, r in zip(n.ops, n.comparators):
                right = self._eval(r, env)
                if not _CMPOPS[type(op)](left, right):
                    return False
                left = right
            return True
        if isinstance(n, ast.Call):
            return FUNCS[n.func.id](*(self._eval(a, env) for a in n.args))
        if isinstance(n, (ast.Tuple, ast.List)):
            return [self._eval(e, env) for e in n.elts]
        raise ValueError(f"cannot evaluate {ast.dump(n)}")


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

    @property
    def size(self) -> int:
        return math.prod(len(v) for v in self.choices.values())

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
                return f"constraint {c.name} ({c.expr.text}) broken: {c.reason}" if c.reason else \
                    f"constraint {c.name} ({c.expr.text}) broken"
        return None

    def grid(self) -> list[dict]:
        """Every combination of the choices (constraints not applied)."""
        names = self.names
        return [dict(zip(names, vals)) for vals in itertools.product(*(self.choices[n] for n in names))]

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


def parse_space(d: Any, src: str, backend: str, fields: list[str]) -> SearchSpace:
    """Validate a search-space document against the backend's parameter field names."""
    check_keys(src, "<top>", d, ("backend", "params", "constraints", "description"), ("backend", "params"))
    if d["backend"] != backend:
        raise ConfigError(f"{src}: backend: file is for {d['backend']!r}, expected {backend!r}")
    params = d["params"]
    if not isinstance(params, dict) or not params:
        raise ConfigError(f"{src}: params: expected a mapping of parameter names to choices")
    unknown = sorted(set(params) - set(fields))
    if unknown:
        raise ConfigError(f"{src}: params.{unknown[0]}: unknown parameter(s) {unknown} for backend {backend!r}; "
                          f"its parameters are {fields}{renamed_hint(unknown, fields)}")
    missing = [f for f in fields if f not in params]
    if missing:
        raise ConfigError(f"{src}: params: missing parameter(s) {missing} for backend {backend!r} "
                          "(every field of its parameter dataclass needs choices)")
    choices = {f: _choices(src, f"params.{f}", params[f]) for f in fields}
    names = list(fields) + list(PROBLEM_NAMES) + list(DEVICE_NAMES)
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
        cons.append(Constraint(str(c.get("name", f"c{i}")), Expr(c["expr"], names, f"{src}: {key}.expr"),
                               str(c.get("reason", ""))))
    return SearchSpace(backend, choices, tuple(cons), src)


def load_space(backend: str, fields: list[str], space_dir: str | Path | None = None) -> SearchSpace:
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
