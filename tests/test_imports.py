"""Imports at the top (docs/architecture.md, "no import cycles"): a module that imports torch at
the top imports the rest of sharpcli there too; a function-local sharpcli import is in a
torch-free module and says, in a comment above it, what it keeps out of ``sharp``'s start-up
(``# imports torch: kept out of start-up``: torch takes seconds to import, where ``--help`` and
completion take 0.3 s; another import, the milliseconds it saves).
(The cycles themselves: the "No import cycles" contract of ``lint-imports``.)"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules():
    for path in sorted((ROOT / "sharpcli").rglob("*.py")):
        yield path.relative_to(ROOT).as_posix(), path.read_text(encoding="utf-8")


def _is_sharpcli(node: ast.AST) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] == "sharpcli"
    if isinstance(node, ast.Import):
        return any(a.name.split(".")[0] == "sharpcli" for a in node.names)
    return False


def _imports_torch_at_top(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.Import) and any(
            a.name.split(".")[0] == "torch" for a in node.names
        ):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            return True
    return False


def _local_sharpcli_imports(tree: ast.Module) -> list[ast.stmt]:
    """The sharpcli imports inside functions (type-only imports under TYPE_CHECKING aside)."""
    found: dict[int, ast.stmt] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                if _is_sharpcli(inner):
                    found[id(inner)] = inner  # once, also when functions nest
    return list(found.values())


def test_modules_that_import_torch_import_sharpcli_at_the_top():
    found = []
    for relative, text in _modules():
        tree = ast.parse(text)
        if _imports_torch_at_top(tree):
            found += [f"{relative}:{n.lineno}" for n in _local_sharpcli_imports(tree)]
    assert not found, "function-local sharpcli imports in modules that import torch:\n" + "\n".join(
        found
    )


def test_each_function_local_import_says_what_it_keeps_out_of_start_up():
    """The comment above a group of function-local sharpcli imports names the start-up."""
    found = []
    for relative, text in _modules():
        tree = ast.parse(text)
        lines = text.splitlines()
        imports = sorted(_local_sharpcli_imports(tree), key=lambda n: n.lineno)
        previous_end = None
        for node in imports:
            in_group = previous_end is not None and node.lineno == previous_end + 1
            previous_end = node.end_lineno
            if in_group:
                continue
            above = lines[node.lineno - 2].strip()
            if not (above.startswith("#") and "start-up" in above):
                found.append(f"{relative}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert not found, "function-local imports without their reason:\n" + "\n".join(found)


def test_sharp_starts_without_torch():
    """What ``sharp --help`` and completion load imports no torch (the reason for the imports
    kept inside functions)."""
    code = "import sys, sharpcli.cli.app; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert out.stdout.strip() == "False"
