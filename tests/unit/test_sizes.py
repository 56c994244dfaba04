"""Product code stays small enough to read in one sitting (issue 34): no function of `service/`,
`pipelines/` or `transport/` over 60 lines (docstring included), no `pipelines/` module over 450.

The few still over are listed with their size today: each may shrink, none may grow, no other
may join them, and an entry is removed once its module or function is under the limit (a stale
entry fails too, so the list only ever shrinks).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60

#: Still over the module limit: path -> lines today.
KNOWN_MODULES = {}
#: The packages whose functions are held to the limit (everything the wheel ships).
PRODUCT_PACKAGES = ("service", "pipelines", "transport")
#: Still over the function limit: "path::qualified name" -> lines today.
KNOWN_FUNCTIONS = {}


def module_lines(package: str) -> dict[str, int]:
    return {
        str(p.relative_to(ROOT)): len(p.read_text().splitlines())
        for p in sorted((ROOT / package).rglob("*.py"))
    }


def function_lines(package: str) -> dict[str, int]:
    """Every function's and method's span in lines, by "path::Class.name"."""
    out: dict[str, int] = {}
    for p in sorted((ROOT / package).rglob("*.py")):
        _spans(ast.parse(p.read_text()), f"{p.relative_to(ROOT)}::", out)
    return out


def _spans(node: ast.AST, prefix: str, out: dict[str, int]) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            out[prefix + child.name] = (child.end_lineno or child.lineno) - child.lineno + 1
            _spans(child, f"{prefix}{child.name}.", out)
        elif isinstance(child, ast.ClassDef):
            _spans(child, f"{prefix}{child.name}.", out)


def _check(sizes: dict[str, int], limit: int, known: dict[str, int], name: str) -> None:
    over = {k: n for k, n in sizes.items() if n > limit}
    grown = {k: n for k, n in over.items() if n > known.get(k, limit)}
    assert not grown, f"over {limit} lines (or grown past its entry in {name}): {grown}"
    stale = sorted(set(known) - set(over))
    assert not stale, f"under the limit now: remove from {name}: {stale}"


def test_no_pipelines_module_is_over_the_limit() -> None:
    _check(module_lines("pipelines"), MAX_MODULE_LINES, KNOWN_MODULES, "KNOWN_MODULES")


def test_no_product_function_is_over_the_limit() -> None:
    sizes = {k: n for package in PRODUCT_PACKAGES for k, n in function_lines(package).items()}
    _check(sizes, MAX_FUNCTION_LINES, KNOWN_FUNCTIONS, "KNOWN_FUNCTIONS")
