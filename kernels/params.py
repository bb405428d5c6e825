"""Parameter declarations: each backend's tunable parameters, declared once, beside its kernel.

A `Declaration` lists a backend's parameters (name, legal values, default, meaning; every
parameter is an int) and the rules among them that mirror the kernel's static_asserts. The
backend's frozen parameter dataclass is built from it (`declared`), so constructing one
validates it. Everything else reads the same declaration: the search spaces of the tuner
narrow it (`kvtune.tuner.space`), compile-check, the sweep, the export and the runtime build
parameters through the dataclass (`backends.params_from_dict`).

A rule is an expression in the language of the search spaces' constraints (`Expr`): over the
parameters only, it is checked when the dataclass is built; naming the problem (`T`, `Dk`,
`Dv`), it is checked against a problem (`Declaration.check_problem`).

Imports neither torch nor Triton: the tuner reads declarations in processes that must not
import Triton before its interpreter is chosen (`declaration`).
"""
from __future__ import annotations

import ast
import dataclasses
import importlib
import math
import operator
from dataclasses import dataclass
from typing import Any, Iterable

FUNCS = {"min": min, "max": max, "cdiv": lambda a, b: -(-a // b),
         "next_pow2": lambda x: 1 << max(0, (int(x) - 1).bit_length()), "log2": lambda x: int(math.log2(x))}
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
           ast.Mod: operator.mod, ast.Div: operator.truediv, ast.Pow: operator.pow}
_CMPOPS = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
           ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.In: lambda a, b: a in b,
           ast.NotIn: lambda a, b: a not in b}
#: the problem names a declaration's rule may use besides the parameters
RULE_PROBLEM_NAMES = ("T", "Dk", "Dv")


class Expr:
    """A small, safe arithmetic/boolean expression (no attribute access, no calls but FUNCS).

    `where` prefixes every error, raised as `error` (the tuner passes its ConfigError)."""

    def __init__(self, text: str, allowed: Iterable[str], where: str, error: type[ValueError] = ValueError):
        self.text = text
        try:
            self.tree = ast.parse(text, mode="eval").body
        except SyntaxError as e:
            raise error(f"{where}: cannot parse {text!r}: {e.msg}") from None
        allowed = set(allowed)
        self.names = frozenset(n.id for n in ast.walk(self.tree) if isinstance(n, ast.Name) and n.id not in FUNCS)
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Name) and node.id not in allowed and node.id not in FUNCS:
                raise error(f"{where}: unknown name {node.id!r} in {text!r}; known: "
                            f"{sorted(allowed)} and functions {sorted(FUNCS)}")
            if not isinstance(node, (ast.Expression, ast.BoolOp, ast.BinOp, ast.UnaryOp, ast.Compare, ast.Call,
                                     ast.Name, ast.Constant, ast.Load, ast.And, ast.Or, ast.Not, ast.USub,
                                     ast.Tuple, ast.List, *_BINOPS, *_CMPOPS)):
                raise error(f"{where}: {type(node).__name__} is not allowed in {text!r}")
            if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id in FUNCS):
                raise error(f"{where}: only {sorted(FUNCS)} may be called in {text!r}")

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
class Param:
    """One parameter: its legal values (a tuple, or an inclusive `range`), default and meaning.

    launch: a launch-time value (the grid size), not a template value compiled into the kernel."""

    name: str
    legal: tuple | range
    default: int
    doc: str
    launch: bool = False

    def describe(self) -> str:
        """The legal values as an error message says them: 'in [1, 64]' or '2, 4 or 8'."""
        if isinstance(self.legal, range):
            return f"in [{self.legal.start}, {self.legal.stop - 1}]"
        vals = [str(v) for v in self.legal]
        return ", ".join(vals[:-1]) + " or " + vals[-1] if len(vals) > 1 else vals[0]

    def violation(self, v) -> str | None:
        if isinstance(v, bool) or not isinstance(v, int):
            return f"must be an int, got {v!r}"
        if v not in self.legal:
            return f"must be {self.describe()}, got {v}"
        return None


@dataclass(frozen=True)
class Rule:
    """A constraint the kernel static_asserts; `field` is the parameter an error names."""

    name: str
    field: str
    expr: Expr
    reason: str

    @property
    def needs_problem(self) -> bool:
        return bool(self.expr.names & set(RULE_PROBLEM_NAMES))


class Declaration:
    """The parameters of one backend (`type_name`: its dataclass) and the rules among them.

    rules: (name, field, expression, reason) tuples; an expression may use the parameters and
    `RULE_PROBLEM_NAMES`. nsplit_per_batch: NSPLIT counts splits of the whole batch's keys (the
    CUDA kernels balance work by keys; split tables are looked up at the batch's key count and a
    launch can serve a per-context dispatch), not splits per request (Triton)."""

    def __init__(self, type_name: str, params: Iterable[Param], rules: Iterable[tuple[str, str, str, str]] = (),
                 nsplit_per_batch: bool = False):
        self.type_name = type_name
        self.nsplit_per_batch = nsplit_per_batch
        self.params = {p.name: p for p in params}
        names = list(self.params) + list(RULE_PROBLEM_NAMES)
        self.rules = tuple(Rule(n, f, Expr(e, names, f"{type_name} rule {n}"), r) for n, f, e, r in rules)
        for r in self.rules:
            if r.field not in names:
                raise ValueError(f"{type_name} rule {r.name}: field {r.field!r} is not a parameter")

    @property
    def names(self) -> list[str]:
        return list(self.params)

    @property
    def template_names(self) -> list[str]:
        """The parameters compiled into the kernel (all but the launch-time ones)."""
        return [n for n, p in self.params.items() if not p.launch]

    def defaults(self) -> dict:
        return {n: p.default for n, p in self.params.items()}

    def _fail(self, field: str, msg: str):
        raise ValueError(f"{self.type_name + '.' if field in self.params else ''}{field}: {msg}")

    def _check_rules(self, values: dict, problem: bool, env: dict | None = None) -> None:
        scope = dict(values, **(env or {}))
        for r in self.rules:
            if r.needs_problem == problem and not r.expr(scope):
                shown = {n: scope[n] for n in sorted(r.expr.names)}
                self._fail(r.field, f"{r.reason} ({r.expr.text} is false for {shown})")

    def check(self, values: dict) -> None:
        """ValueError naming `<type_name>.<field>` unless `values` (every parameter) is legal
        on its own: each value legal, and every rule over the parameters alone."""
        for n, p in self.params.items():
            why = p.violation(values[n])
            if why:
                self._fail(n, why)
        self._check_rules(values, problem=False)

    def check_problem(self, values: dict, **problem) -> None:
        """The rules that name the problem (T, Dk, Dv given as keywords), as ValueErrors."""
        self._check_rules(values, problem=True, env=problem)


def declared(decl: Declaration):
    """Class decorator: the frozen dataclass whose fields are `decl`'s parameters, in order,
    with their defaults, validated by `decl.check` when built. The class body adds methods."""
    def wrap(cls):
        cls.__annotations__ = {n: "int" for n in decl.params}
        for n, p in decl.params.items():
            setattr(cls, n, p.default)
        cls.__post_init__ = lambda self: decl.check({n: getattr(self, n) for n in decl.params})
        cls = dataclass(frozen=True)(cls)
        cls.declaration = decl
        return cls
    return wrap


# backend name -> "module:attribute" of its parameter dataclass. Not the backend registry:
# that one imports the kernel (Triton), and the tuner reads declarations before it may.
_PARAM_TYPES: dict[str, str] = {
    "triton": "kvtune.kernels.triton_params:TritonParams",
    "cuda": "kvtune.kernels.cuda.params:CudaParams",
    "wgmma": "kvtune.kernels.cuda.params:WgmmaParams",
    "wgmma_km": "kvtune.kernels.cuda.params:WgmmaKmParams",
}


def params_type(backend: str) -> type:
    """The parameter dataclass of `backend` (its `.declaration` is the declaration). A backend
    registered under another name (tests' variants) is asked for its `params_type`."""
    if backend in _PARAM_TYPES:
        module, attr = _PARAM_TYPES[backend].split(":")
        return getattr(importlib.import_module(module), attr)
    from .backends import get_backend
    t = get_backend(backend).params_type
    if t is None:
        raise ValueError(f"backend {backend!r} has no parameters")
    return t


def declaration(backend: str) -> Declaration:
    """The declaration of `backend`'s parameters."""
    t = params_type(backend)
    decl = getattr(t, "declaration", None)
    if decl is None:  # a dataclass written by hand (a test's backend): its fields, any int
        decl = Declaration(t.__name__, [Param(f.name, range(-2**31, 2**31), f.default, "")
                                        for f in dataclasses.fields(t)])
    return decl


def nsplit_per_batch(backend: str) -> bool:
    """Whether `backend`'s NSPLIT counts the batch's splits (`Declaration.nsplit_per_batch`): False
    for a backend without parameters (the oracle) or one that cannot be loaded here."""
    try:
        return declaration(backend).nsplit_per_batch
    except (ImportError, ValueError):
        return False
