"""The check that a registry is the one list of its kind (methods, record formats, export types): no module outside
it compares a value with one of the registered names (`x == "dpo"`, `x in ("hf", ...)`, `match x: case "gguf"`)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "finetune"


def name_comparisons(tree: ast.AST, names) -> list[tuple[int, str]]:
    """(line, name) of each comparison with one of `names` as a string literal."""

    def literals(node) -> list[str]:
        if isinstance(node, ast.Constant) and node.value in names:
            return [node.value]
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in names]
        return []

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            found += [(node.lineno, n) for side in (node.left, *node.comparators) for n in literals(side)]
        elif isinstance(node, ast.MatchValue):
            found += [(node.lineno, n) for n in literals(node.value)]
    return found


def comparisons_outside(names, home: str, allowed: dict[str, str] | None = None) -> list[str]:
    """'file:line compares name' for every module of the package outside `home` (a folder or file under finetune/)
    and outside `allowed` (path -> why it may)."""
    allowed = allowed or {}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        if where == home or where.startswith(home.rstrip("/") + "/") or where in allowed:
            continue
        found += [f"{where}:{line} compares {name!r}"
                  for line, name in name_comparisons(ast.parse(path.read_text(), str(path)), names)]
    return found
