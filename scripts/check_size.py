#!/usr/bin/env python3
"""Size limits of the Python code (run by scripts/test.sh beside `ruff check`): no file over
600 lines and no function over 80 lines, outside the kernels' own bodies.

The kernels (the Triton `@triton.jit` functions and kernels/cuda/verify.cu) are exempt: a
kernel is read as one unit and splitting it costs registers or clarity. Prints each offender
as `path:line: what` and exits 1 if there is any.

    python scripts/check_size.py [paths ...]   # default: kernels tuner scripts tests
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80


def _is_kernel(fn: ast.AST) -> bool:
    for d in getattr(fn, "decorator_list", []):
        name = ast.unparse(d.func if isinstance(d, ast.Call) else d)
        if name.split(".")[-1] == "jit" and name.startswith("triton"):
            return True
    return False


def offenders(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    out = []
    n = text.count("\n") + (not text.endswith("\n"))
    if n > MAX_FILE_LINES:
        out.append(f"{path}:1: {n} lines (> {MAX_FILE_LINES}): split it by responsibility")
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_kernel(node):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                out.append(f"{path}:{node.lineno}: function {node.name} is {length} lines (> {MAX_FUNCTION_LINES})")
    return out


def main(argv: list[str]) -> int:
    roots = [Path(a) for a in argv] or [Path(p) for p in ("kernels", "tuner", "scripts", "tests")]
    files = sorted(f for r in roots for f in ([r] if r.is_file() else r.rglob("*.py")))
    bad = [line for f in files for line in offenders(f)]
    for line in bad:
        print(line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
