"""Training code stays out of the runtime: a serving process never imports ``decoding.training``.

``meshd heads train`` imports it inside the command; the daemon (``meshd join``
builds the same CLI parser), its stages and every other ``decoding`` module
must not, not even lazily inside a function (the AST check sees those).
"""

import ast
import subprocess
import sys
from pathlib import Path

from tests.support.imports import imported_modules

ROOT = Path(__file__).resolve().parents[2]
TRAINING = "decoding.training"
# The one runtime-side module allowed to import training: the command that runs it, lazily.
ALLOWED = {Path("meshd/commands/heads.py")}


def _is_training(module: str) -> bool:
    return module == TRAINING or module.startswith(TRAINING + ".")


def test_no_runtime_module_imports_training_code():
    offenders = []
    for package in ("decoding", "meshd", "transport", "partition"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if rel in ALLOWED or rel.parts[:2] == ("decoding", "training"):
                continue
            tree = ast.parse(path.read_text(), filename=str(path))
            offenders += [f"{rel}:{line}: import {mod}" for line, mod in imported_modules(tree) if _is_training(mod)]
    assert not offenders, "runtime modules must not import training code:\n" + "\n".join(offenders)


def test_the_heads_command_imports_training_only_inside_its_functions():
    tree = ast.parse((ROOT / "meshd/commands/heads.py").read_text())
    top_level = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not [m for n in top_level for _, m in imported_modules(n) if _is_training(m)]


def test_importing_the_daemon_and_its_stages_loads_no_training_module():
    decoding_modules = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                              for p in (ROOT / "decoding").rglob("*.py")
                              if p.relative_to(ROOT).parts[:2] != ("decoding", "training"))
    code = ("import sys\n"
            f"for name in {decoding_modules!r}:\n"
            "    __import__(name)\n"
            "import meshd.daemon, tests.support.stage_proc, meshd.engine.drafting, meshd.model.heads, meshd.cloud.verifier\n"
            "import meshd.cli\n"
            "meshd.cli.build_parser()  # `meshd join` registers every command, `heads` included\n"
            "print(sorted(m for m in sys.modules if m == 'decoding.training' or m.startswith('decoding.training.')))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_check_sees_lazy_imports_and_submodules_imported_from_their_package():
    src = "def f():\n    from decoding import training\n    import decoding.training.medusa\n"
    assert [m for _, m in imported_modules(ast.parse(src)) if _is_training(m)] == [
        "decoding.training", "decoding.training.medusa"]
    assert not [m for _, m in imported_modules(ast.parse("from decoding import medusa\n")) if _is_training(m)]
