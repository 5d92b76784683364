"""Layering: ``transport``, ``partition`` and ``decoding`` never import ``meshd``.

meshd (the daemon, CLI and API) is built on these packages, not the other way
round: each has its own base error (``TransportError``, ``PartitionError``,
``DecodingError``) and its own ``log.get_logger``, and meshd wraps them
(``meshd.errors.USER_ERRORS``). The check reads the source with ``ast``, so an
import hidden inside a function, a conditional or ``TYPE_CHECKING`` counts too.
"""

import ast
import subprocess
import sys

import pytest
from tests.support.repo import ROOT

LOWER = ("transport", "partition", "decoding")
FORBIDDEN = "meshd"


def _imports(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module
        elif isinstance(node, ast.Call):  # importlib.import_module("meshd...") / __import__("meshd")
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name in ("import_module", "__import__") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    yield node.lineno, arg.value


def _sources(package: str):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no sources under {package}/"
    return files


def _is_forbidden(module: str) -> bool:
    return module == FORBIDDEN or module.startswith(FORBIDDEN + ".")


@pytest.mark.parametrize("package", LOWER)
def test_lower_packages_never_import_meshd(package):
    offenders = []
    for path in _sources(package):
        tree = ast.parse(path.read_text(), filename=str(path))
        offenders += [f"{path.relative_to(ROOT)}:{line}: import {mod}"
                      for line, mod in _imports(tree) if _is_forbidden(mod)]
    assert not offenders, "lower layers must not import meshd:\n" + "\n".join(offenders)


def test_the_check_sees_imports_inside_functions():
    src = "def f():\n    from meshd.model_store import sha256_of\n    import meshd.log as l\n"
    assert [m for _, m in _imports(ast.parse(src)) if _is_forbidden(m)] == ["meshd.model_store", "meshd.log"]
    assert not [m for _, m in _imports(ast.parse("import meshdx\nfrom transport import wire\n"))
                if _is_forbidden(m)]


def test_importing_the_lower_packages_loads_no_meshd_module():
    code = ("import sys\n"
            "import transport, transport.node, transport.link, transport.auth, transport.tuning\n"
            "import partition.planner, partition.profiler, partition.synthetic\n"
            "import decoding.loader, decoding.loader.gguf_source, decoding.loader.hf_source\n"
            "import decoding.sampling, decoding.generate, decoding.kv_cache\n"
            "print(sorted(m for m in sys.modules if m == 'meshd' or m.startswith('meshd.')))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_meshd_treats_every_layers_base_error_as_user_facing():
    from decoding.errors import CacheError, DecodingError, ModelLoadError
    from decoding.sampling import BadSamplingParams
    from meshd.errors import USER_ERRORS, MeshdError
    from partition.errors import PartitionError
    from partition.layers import PlanError
    from partition.link import LinkSpecError
    from partition.profile import ProfileError
    from transport.errors import KeyStoreError, TransportError

    for base in (MeshdError, TransportError, PartitionError, DecodingError):
        assert base in USER_ERRORS
    for err in (ModelLoadError, CacheError, BadSamplingParams, PlanError, LinkSpecError, ProfileError,
                KeyStoreError):
        assert issubclass(err, USER_ERRORS)
        assert not issubclass(err, MeshdError)  # the lower layers stand alone


def test_the_cli_prints_a_lower_layer_error_as_one_line(tmp_path, capsys):
    from tests.support.daemons import run_cli

    bad = tmp_path / "weights.bin"
    bad.write_bytes(b"PK\x03\x04 not a model")
    capsys.readouterr()
    rc, _ = run_cli("generate", "--model", str(bad), "--prompt", "hi")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1
    assert err == [f"meshd: error: {bad}: unrecognised model format (expected a GGUF file or a Hugging Face "
                   f"directory; file starts with b'PK\\x03\\x04')"]
