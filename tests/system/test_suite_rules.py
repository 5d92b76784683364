"""The test suite's own rules, checked on its source with ``ast`` (as the layering test reads meshd's).

- No test module imports another: what two modules share is a fixture in a ``conftest.py`` or a
  plain module in ``tests/support/``. A test module imported by another runs its module-level code
  (and registers its fixtures) twice, under two names, and ties the two files together.
- No sleep assumes an idle machine: a test waits on the condition itself, with a deadline
  (``tests.support.waiting``). A sleep that *is* the point (a slow fake engine, a client pausing
  mid-prompt, the poll interval of a wait with a deadline) says so on its line: ``# sleep-ok: why``.
- Every test checks its claim: an ``assert``, ``pytest.raises``/``warns``/``fail``, a wait that
  fails on its deadline, or a call to a helper that asserts (named ``assert_*``/``expect_*``/
  ``check_*``, or a function of the same module that asserts).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.repo import ROOT

TESTS = ROOT / "tests"
SLEEP_OK = "# sleep-ok:"
ASSERTING_PREFIXES = ("assert_", "expect_", "check_")
# Calls that fail the test when the claim does not hold.
ASSERTING_CALLS = {"raises", "warns", "deprecated_call", "fail", "wait_until", "eventually"}


def _python_files() -> list[Path]:
    files = sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)
    assert len(files) > 50, "the suite's sources were not found"
    return files


def _is_test_module(name: str) -> bool:
    return any(part.startswith("test_") for part in name.split("."))


def _imported_names(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    return ([base] if base else []) + [f"{base}.{a.name}" if base else a.name for a in node.names]


def _test_module_imports(path: Path, source: str) -> list[str]:
    """``path:line: the import`` for each import of a test module (``tests.….test_*``, or relative)."""
    out = []
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        relative = isinstance(node, ast.ImportFrom) and node.level > 0
        if any((relative or n.startswith("tests.")) and _is_test_module(n) for n in _imported_names(node)):
            out.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return out


def _unmarked_sleeps(path: Path, source: str) -> list[str]:
    """``path:line`` of each ``sleep(...)`` call without a ``# sleep-ok:`` reason on its line."""
    lines = source.splitlines()
    out = []
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name == "sleep" and SLEEP_OK not in lines[node.lineno - 1]:
                out.append(f"{path.relative_to(ROOT)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return out


def _call_name(node: ast.Call) -> str:
    fn = node.func
    return fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")


def _asserts(fn: ast.AST, asserting_helpers: set[str]) -> bool:
    for node in ast.walk(fn):
        if isinstance(node, ast.Assert):
            return True
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if getattr(exc, "id", "") == "AssertionError":
                return True
        if isinstance(node, ast.Call):
            name = _call_name(node)
            if name.startswith(ASSERTING_PREFIXES) or name in ASSERTING_CALLS or name in asserting_helpers:
                return True
    return False


def _tests_that_check_nothing(path: Path, source: str) -> list[str]:
    functions = [n for n in ast.walk(ast.parse(source, filename=str(path)))
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    helpers: set[str] = set()
    grew = True
    while grew:  # a helper that calls a helper that asserts, asserts
        grew = False
        for fn in functions:
            if not fn.name.startswith("test_") and fn.name not in helpers and _asserts(fn, helpers):
                helpers.add(fn.name)
                grew = True
    return [f"{path.relative_to(ROOT)}:{fn.lineno}: {fn.name}" for fn in functions
            if fn.name.startswith("test_") and not _asserts(fn, helpers)]


def test_no_test_module_imports_another():
    offenders = [o for p in _python_files() for o in _test_module_imports(p, p.read_text())]
    assert not offenders, ("share through tests/conftest.py or tests/support/, not by importing a test "
                           "module:\n" + "\n".join(offenders))


def test_no_sleep_without_a_reason():
    offenders = [o for p in _python_files() for o in _unmarked_sleeps(p, p.read_text())]
    assert not offenders, ("wait on the condition with a deadline (tests.support.waiting), or say on the "
                           f"line why the sleep is the point ({SLEEP_OK} ...):\n" + "\n".join(offenders))


def test_every_test_checks_its_claim():
    offenders = [o for p in sorted(TESTS.rglob("test_*.py")) for o in _tests_that_check_nothing(p, p.read_text())]
    assert not offenders, "tests that assert nothing:\n" + "\n".join(offenders)


def test_helpers_are_plain_modules_and_every_folder_a_package():
    """tests/support/ holds no tests; each test folder is a package (so two folders may share a
    file name) and none is left flat at the top."""
    assert not list((TESTS / "support").glob("test_*.py"))
    assert not list(TESTS.glob("test_*.py")), "test modules live in the folder of what they test"
    for folder in (p for p in TESTS.iterdir() if p.is_dir() and list(p.glob("test_*.py"))):
        assert (folder / "__init__.py").exists(), f"{folder.relative_to(ROOT)} has no __init__.py"


# ------------------------------------------------------------------ the checks bite

def test_the_checks_see_what_they_forbid():
    path = TESTS / "x" / "test_fake.py"  # shown relative to the repository
    imports = ("from tests.api.test_api_ollama import client\nimport tests.test_daemon_helpers\n"
               "from tests.support.api import FakeEngine\nfrom .test_other import x\nfrom tests.api import test_y\n")
    assert [o.split(":")[1] for o in _test_module_imports(path, imports)] == ["1", "2", "4", "5"]
    sleeps = ("import time\ntime.sleep(1)\nasyncio.sleep(0)  # sleep-ok: yields\n"
              "s = 'time.sleep(60)'\n")
    assert [o.split(":")[1] for o in _unmarked_sleeps(path, sleeps)] == ["2"]
    tests = ("def _check(x):\n    assert x\n\ndef _via(x):\n    _check(x)\n\n"
             "def test_a():\n    _via(1)\n\ndef test_b():\n    print(1)\n\n"
             "async def test_c():\n    with pytest.raises(ValueError):\n        int('x')\n\n"
             "def test_d():\n    wait_until(lambda: True, 1, 'x')\n")
    assert [o.rpartition(": ")[2] for o in _tests_that_check_nothing(path, tests)] == ["test_b"]
