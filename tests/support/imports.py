"""The modules a source file imports, read with ``ast`` for the layering checks.

Reading the source (not ``sys.modules``) means an import hidden inside a
function, a conditional or ``TYPE_CHECKING`` counts too.
"""

from __future__ import annotations

import ast


def imported_modules(tree: ast.AST):
    """(line, module) for every import in ``tree``: ``import a.b``, ``from a.b import c`` (as ``a.b`` and
    ``a.b.c``: c may be a submodule), and ``importlib.import_module("a.b")`` / ``__import__("a.b")``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module
            for alias in node.names:
                yield node.lineno, f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name in ("import_module", "__import__") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    yield node.lineno, arg.value
