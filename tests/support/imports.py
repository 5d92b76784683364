"""The modules a source file imports, read with ``ast`` for the layering checks.

Reading the source (not ``sys.modules``) means an import hidden inside a
function, a conditional or ``TYPE_CHECKING`` counts too.
"""

from __future__ import annotations

import ast


def imported_modules(tree: ast.AST, module: str = ""):
    """(line, dotted name) of everything ``tree`` imports, lazily or not; ``module`` (the file's own dotted name,
    a package's ending in ``.__init__``) resolves relative imports. ``from a import b`` yields
    ``a`` and ``a.b``, since ``b`` may be a module."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.split(".")[:-node.level]
                if not parent:
                    continue  # beyond the top package: Python refuses it anyway
                base = ".".join(parent + ([node.module] if node.module else []))
            if not base:
                continue
            yield node.lineno, base
            for alias in node.names:
                if alias.name != "*":
                    yield node.lineno, f"{base}.{alias.name}"
        elif isinstance(node, ast.Call):  # importlib.import_module("meshd...") / __import__("meshd")
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name in ("import_module", "__import__") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    yield node.lineno, arg.value



def runtime_import_statements(tree: ast.Module):
    """The import statements that run when the module is imported: at module level, also inside
    ``if``/``try``/``with`` blocks and class bodies, but not inside functions (they run later) nor under
    ``if TYPE_CHECKING`` (never). What an import cycle is made of."""
    todo = list(reversed(tree.body))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        if isinstance(node, ast.If) and _names_type_checking(node.test):
            todo.extend(reversed(node.orelse))
            continue
        for name in ("finalbody", "orelse", "handlers", "body"):
            todo.extend(reversed(getattr(node, name, None) or []))


def _names_type_checking(test: ast.expr) -> bool:
    return (test.attr if isinstance(test, ast.Attribute) else getattr(test, "id", "")) == "TYPE_CHECKING"
