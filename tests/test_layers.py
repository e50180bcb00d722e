"""The layering of docs/layout.md holds: import-linter's contracts in pyproject.toml are kept (imports inside
functions count like any other), and no two of finetune's modules import each other in a loop."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grimp

REPO = Path(__file__).resolve().parent.parent
LINT = "from importlinter.cli import lint_imports_command; lint_imports_command()"


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """`lint-imports` on the package and pyproject.toml under `root` (the interpreter's own import-linter)."""
    return subprocess.run([sys.executable, "-c", LINT, "--no-cache", "--no-logo"], cwd=root, text=True,
                          capture_output=True, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)}, timeout=120)


def broken_contracts(output: str) -> list[str]:
    return [line.removesuffix(" BROKEN") for line in output.splitlines() if line.endswith(" BROKEN")]


def test_contracts_kept():
    run = lint_imports(REPO)
    broken = broken_contracts(run.stdout)
    assert run.returncode == 0 and not broken, (
        f"import-linter contracts broken: {broken or '(none named)'}\n{run.stdout[-6000:]}{run.stderr[-2000:]}")
    assert "Contracts: 2 kept, 0 broken." in run.stdout, run.stdout


def test_an_import_inside_a_function_against_the_layers_breaks_the_contract(tmp_path):
    # The check is not vacuous: a lazy import of config from models (the kind the layering forbids and a reader
    # of the top of the file cannot see) breaks the layers contract, named.
    shutil.copytree(REPO / "finetune", tmp_path / "finetune", ignore=shutil.ignore_patterns("__pycache__", "quickstart_data"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    with (tmp_path / "finetune" / "models" / "tiny.py").open("a") as f:
        f.write("\n\ndef _against_the_layers():\n    from finetune.config import parser\n\n    return parser\n")
    run = lint_imports(tmp_path)
    assert run.returncode != 0
    # config imports models for its checks, so the package circle is named as well.
    assert broken_contracts(run.stdout) == ["finetune's layers (docs/layout.md)",
                                            "no import circles between finetune's modules or packages"], run.stdout
    assert "finetune.models.tiny -> finetune.config.parser" in run.stdout, run.stdout


def import_loops(graph) -> list[list[str]]:
    """Strongly connected sets of more than one module (Tarjan's algorithm), each sorted."""
    modules = sorted(graph.modules)
    index, low, on_stack, stack, loops, counter = {}, {}, set(), [], [], [0]

    def visit(start: str) -> None:
        # Iterative, so a long import chain cannot reach the recursion limit.
        work = [(start, iter(sorted(graph.find_modules_directly_imported_by(start))))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1:
                    loops.append(sorted(members))

    for module in modules:
        if module not in index:
            visit(module)
    return loops


def describe(graph, loop: list[str]) -> str:
    members = set(loop)
    lines = []
    for importer in loop:
        for imported in sorted(graph.find_modules_directly_imported_by(importer) & members):
            at = ", ".join(f"l.{d['line_number']}" for d in graph.get_import_details(importer=importer, imported=imported))
            lines.append(f"  {importer} -> {imported} ({at})")
    return "\n".join(lines)


def test_no_import_loops_between_modules():
    graph = grimp.build_graph("finetune", cache_dir=None)
    loops = import_loops(graph)
    assert not loops, "modules that import each other in a loop (imports inside functions included):\n" + "\n".join(
        describe(graph, loop) for loop in loops)


def test_the_loop_finder_finds_a_loop():
    graph = grimp.build_graph("finetune", cache_dir=None)
    graph.add_import(importer="finetune.compat", imported="finetune.training.checkpoint")
    assert ["finetune.compat", "finetune.training.checkpoint"] in import_loops(graph)
