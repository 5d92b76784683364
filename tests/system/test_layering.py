"""Layering: each floor of the house imports only the floors below it.

``transport``, ``partition`` and ``decoding`` never import ``meshd``: meshd (the daemon, CLI and
API) is built on these packages, not the other way round: each has its own base error
(``TransportError``, ``PartitionError``, ``DecodingError``) and its own ``log.get_logger``, and
meshd wraps them (``meshd.errors.USER_ERRORS``).

Inside meshd, the control plane (``meshd.mesh``: members, gossip, planning) sits below the rooms
that use it (``meshd.pipeline``, ``meshd.share``, ``meshd.api``), which get a view of the mesh and
callbacks, never the daemon: only the CLI entry points import ``meshd.daemon``, which wires the
rooms together, and nothing below the CLI imports the CLI. A rule about a package that does not
exist yet passes (it has no sources) and bites from the day it does.

The check reads the source with ``ast``, so an import hidden inside a function, a conditional or
``TYPE_CHECKING`` counts too, as do relative imports and ``from meshd import daemon``.
"""

import ast
import subprocess
import sys

import pytest

from tests.support.imports import imported_modules
from tests.support.repo import ROOT

LOWER = ("transport", "partition", "decoding")
FORBIDDEN = "meshd"


def _module_name(path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _sources(package: str):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no sources under {package}/"
    return files


def _is_forbidden(module: str) -> bool:
    return _within(module, FORBIDDEN)


@pytest.mark.parametrize("package", LOWER)
def test_lower_packages_never_import_meshd(package):
    offenders = []
    for path in _sources(package):
        tree = ast.parse(path.read_text(), filename=str(path))
        offenders += [f"{path.relative_to(ROOT)}:{line}: import {mod}"
                      for line, mod in imported_modules(tree) if _is_forbidden(mod)]
    assert not offenders, "lower layers must not import meshd:\n" + "\n".join(offenders)


def test_the_check_sees_imports_inside_functions():
    src = "def f():\n    from meshd.model.store import sha256_of\n    import meshd.log as l\n"
    assert [m for _, m in imported_modules(ast.parse(src)) if _is_forbidden(m)] == [
        "meshd.model.store", "meshd.model.store.sha256_of", "meshd.log"]
    assert not [m for _, m in imported_modules(ast.parse("import meshdx\nfrom transport import wire\n"))
                if _is_forbidden(m)]


# ------------------------------------------------------------------ the upper floors, inside meshd

# Where the CLI starts: the only modules that may import the daemon (and the CLI itself).
ENTRY_POINTS = ("meshd.cli", "meshd.__main__", "meshd.commands")
# (who, what it must never import): the control plane is below the rooms that use it.
BELOW = [("meshd.mesh", ("meshd.pipeline", "meshd.share", "meshd.api"))]


def _meshd_modules():
    """(path, dotted module name) of every source file in meshd/ (``pkg.__init__`` for a package)."""
    return [(path, _module_name(path)) for path in _sources("meshd")]


def _violations(modules, may_import, forbidden: tuple[str, ...]) -> list[str]:
    out = []
    for path, module in modules:
        if may_import(module):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        out += [f"{shown}:{line}: import {name}" for line, name in imported_modules(tree, module)
                if any(_within(name, f) for f in forbidden)]
    return sorted(set(out))


@pytest.mark.parametrize("lower,upper", BELOW, ids=[lower for lower, _ in BELOW])
def test_the_control_plane_never_imports_the_rooms_above_it(lower, upper):
    mine = [(p, m) for p, m in _meshd_modules() if _within(m, lower)]
    offenders = _violations(mine, lambda m: False, upper)
    assert not offenders, f"{lower} sits below {', '.join(upper)}:\n" + "\n".join(offenders)


def test_only_the_cli_entry_points_import_the_daemon():
    """The daemon wires the rooms; a room that imported it would reach round the view it is given."""
    offenders = _violations(_meshd_modules(),
                            lambda m: _within(m, "meshd.daemon") or any(_within(m, e) for e in ENTRY_POINTS),
                            ("meshd.daemon",))
    assert not offenders, "only meshd/cli.py, meshd/__main__.py and meshd/commands/ import meshd.daemon:\n" \
        + "\n".join(offenders)


def test_nothing_below_the_cli_imports_it():
    offenders = _violations(_meshd_modules(), lambda m: any(_within(m, e) for e in ENTRY_POINTS),
                            ENTRY_POINTS)
    assert not offenders, "the CLI is the top floor:\n" + "\n".join(offenders)


def test_the_check_resolves_relative_imports_and_names_imported_from_a_package():
    src = ("from . import daemon\nfrom ..pipeline.serving import x\nfrom .state import Member\n"
           "from meshd import daemon as d\n")
    got = [m for _, m in imported_modules(ast.parse(src), "meshd.mesh.view")]
    assert got == ["meshd.mesh", "meshd.mesh.daemon", "meshd.pipeline.serving", "meshd.pipeline.serving.x",
                   "meshd.mesh.state", "meshd.mesh.state.Member", "meshd", "meshd.daemon"]
    # a package's __init__ is its own package's member: "from . import x" is a sibling of its modules
    assert [m for _, m in imported_modules(ast.parse("from . import daemon\n"), "meshd.__init__")] == [
        "meshd", "meshd.daemon"]


def test_a_rule_bites_once_its_package_exists(tmp_path):
    room = tmp_path / "view.py"
    room.write_text("def status():\n    from meshd.pipeline import serving\n")
    got = _violations([(room, "meshd.mesh.view")], lambda m: False, BELOW[0][1])
    assert [g.rpartition(":2: ")[2] for g in got] == ["import meshd.pipeline", "import meshd.pipeline.serving"]


def test_importing_the_lower_packages_loads_no_meshd_module():
    code = ("import sys\n"
            "import transport, transport.node, transport.link, transport.auth, transport.tuning\n"
            "import partition.planner, partition.machine, partition.scaling, partition.synthetic\n"
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
