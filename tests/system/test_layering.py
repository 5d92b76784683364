"""Layering: each floor of the house imports only the floors below it.

``transport``, ``partition`` and ``decoding`` never import ``meshd``: meshd (the daemon, CLI and
API) is built on these packages, not the other way round: each has its own base error
(``TransportError``, ``PartitionError``, ``DecodingError``) and its own ``log.get_logger``, and
meshd wraps them (``meshd.errors.USER_ERRORS``). Among themselves they are floors too, bottom up:
``partition`` is pure (profiles, the planners, the plan, and the typed ids every package shares),
``decoding`` runs the model and names what it holds with partition's ids, ``transport`` carries
decoding's sampling spec in its messages. None imports a floor above it; what measures a device by
running the model (``meshd.model.profiler``) lives above them all.

Inside meshd, the control plane (``meshd.mesh``: members, gossip, planning) sits below the rooms
that use it (``meshd.pipeline``, ``meshd.share``, ``meshd.api``), which get a view of the mesh and
callbacks, never the daemon: only the CLI entry points import ``meshd.daemon``, which wires the
rooms together, and nothing below the CLI imports the CLI. The engine seam (``meshd.engine``) and the
model files (``meshd.model``) sit below serving (``meshd.pipeline``), which sits below the API, sharing and
the cloud peer. A rule about a package that does not exist yet passes (it has no sources) and bites from
the day it does. No two of our modules import each other when they are imported (no import cycle).

The check reads the source with ``ast``, so an import hidden inside a function, a conditional or
``TYPE_CHECKING`` counts too, as do relative imports and ``from meshd import daemon``.
"""

import ast
import subprocess
import sys

import pytest

from tests.support.imports import imported_modules, runtime_import_statements
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


# The lower floors, bottom up: each may import those before it, never one after it.
GROUND = ("partition", "decoding", "transport")


def _package_modules(package: str):
    """(path, dotted module name) of every source file in ``package`` (``pkg.__init__`` for a package)."""
    return [(path, _module_name(path)) for path in _sources(package)]


@pytest.mark.parametrize("package", GROUND)
def test_the_lower_floors_never_import_a_floor_above_them(package):
    above = GROUND[GROUND.index(package) + 1:]
    offenders = _violations(_package_modules(package), lambda m: False, above)
    assert not offenders, f"{package} sits below {', '.join(above)}:\n" + "\n".join(offenders)


@pytest.mark.parametrize("module, source, caught", [
    ("partition.profile", "def f():\n    from decoding.models import StageModel\n", "import decoding.models"),
    ("partition.plan", "import transport.messages\n", "import transport.messages"),
    ("decoding.offload.loop", "from transport.messages import CloudVerify\n", "import transport.messages"),
])
def test_a_ground_floor_rule_bites(tmp_path, module, source, caught):
    path = tmp_path / "m.py"
    path.write_text(source)
    package = module.partition(".")[0]
    got = _violations([(path, module)], lambda m: False, GROUND[GROUND.index(package) + 1:])
    assert caught in [g.split(": ", 1)[1] for g in got]


def test_the_check_sees_imports_inside_functions():
    src = "def f():\n    from meshd.model.store import sha256_of\n    import meshd.log as l\n"
    assert [m for _, m in imported_modules(ast.parse(src)) if _is_forbidden(m)] == [
        "meshd.model.store", "meshd.model.store.sha256_of", "meshd.log"]
    assert not [m for _, m in imported_modules(ast.parse("import meshdx\nfrom transport import wire\n"))
                if _is_forbidden(m)]


# ------------------------------------------------------------------ the upper floors, inside meshd

# Where the CLI starts: the only modules that may import the daemon (and the CLI itself).
ENTRY_POINTS = ("meshd.cli", "meshd.__main__", "meshd.commands")
# (who, what it must never import): the control plane, the engine seam and the model files are below the
# rooms that use them; serving is below the API, sharing and the cloud peer.
BELOW = [
    ("meshd.mesh", ("meshd.pipeline", "meshd.share", "meshd.api", "meshd.engine", "meshd.cloud")),
    ("meshd.engine", ("meshd.pipeline", "meshd.share", "meshd.api", "meshd.mesh", "meshd.cloud")),
    ("meshd.model", ("meshd.pipeline", "meshd.share", "meshd.api", "meshd.mesh", "meshd.engine", "meshd.cloud")),
    ("meshd.pipeline", ("meshd.share", "meshd.api", "meshd.cloud")),
]
# Modules a rule above does not hold for, and why.
EXEMPT = {
    # owns the model on this device: builds the engine, starts serving and plans the device with the
    # control plane (a room on the daemon's floor that lives beside the model files)
    "meshd.model.host": "the daemon's floor",
}


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
def test_a_room_never_imports_the_rooms_above_it(lower, upper):
    mine = [(p, m) for p, m in _meshd_modules() if _within(m, lower)]
    offenders = _violations(mine, lambda m: m in EXEMPT, upper)
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


@pytest.mark.parametrize("module, source, caught", [
    ("meshd.engine.local", "from meshd.pipeline.engine import PipelineEngine\n", "import meshd.pipeline.engine"),
    ("meshd.model.store", "def f():\n    from meshd.mesh.view import MeshView\n", "import meshd.mesh.view"),
    ("meshd.pipeline.serving", "import meshd.api.openai_routes\n", "import meshd.api.openai_routes"),
])
def test_each_rooms_rule_bites(tmp_path, module, source, caught):
    path = tmp_path / "m.py"
    path.write_text(source)
    rule = next(upper for lower, upper in BELOW if _within(module, lower))
    got = _violations([(path, module)], lambda m: m in EXEMPT, rule)
    assert caught in [g.split(": ", 1)[1] for g in got]


# ------------------------------------------------------------------ no import cycle

OURS = ("meshd", "partition", "decoding", "transport")


def _import_graph(sources) -> dict[str, set[str]]:
    """module -> the modules of ours that importing it runs (``pkg`` stands for a package's ``__init__``).

    ``from a import b`` is an edge to ``a.b`` when that is a module (``a`` is initialised before it in
    any case), else to ``a``."""
    names = {module.removesuffix(".__init__"): (path, module) for path, module in sources}
    graph = {}
    for name, (path, module) in names.items():
        edges = set()
        for node in runtime_import_statements(ast.parse(path.read_text(), filename=str(path))):
            found = [target for _, target in imported_modules(node, module)]
            if isinstance(node, ast.ImportFrom) and found:
                base, members = found[0], found[1:]
                submodules = [m for m in members if m in names]
                found = submodules + ([base] if len(submodules) < len(members) else [])
            edges |= {target for target in found if target in names and target != name}
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work = [(root, iter(sorted(graph[root])))]
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_two_of_our_modules_import_each_other():
    """A cycle makes import order matter (a name is missing while its module is half-initialised) and
    ties two rooms into one; a lazy import inside a function is no cycle."""
    sources = [source for package in OURS for source in _package_modules(package)]
    cycles = _cycles(_import_graph(sources))
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_check_bites_and_reads_only_what_runs_on_import(tmp_path):
    def graph(files: dict[str, str]):
        sources = []
        for module, text in files.items():
            path = tmp_path / f"{module}.py"
            path.write_text(text)
            sources.append((path, module))
        return _import_graph(sources)

    assert _cycles(graph({"pkg.a": "from pkg import b\n", "pkg.b": "import pkg.c\n",
                          "pkg.c": "try:\n    from pkg.a import x\nexcept ImportError:\n    pass\n"})) == [
        ["pkg.a", "pkg.b", "pkg.c"]]
    assert _cycles(graph({"pkg.a": "from pkg import b\n", "pkg.b": "def f():\n    from pkg import a\n",
                          "pkg.c": "if TYPE_CHECKING:\n    import pkg.a\n"})) == []
    # a package's __init__ that imports its module is no cycle with that module importing a sibling
    assert _cycles(graph({"pkg.__init__": "from pkg.a import x\n", "pkg.a": "from pkg import b\n",
                          "pkg.b": "X = 1\n"})) == []


def test_importing_the_lower_packages_loads_no_meshd_module():
    code = ("import sys\n"
            "import transport, transport.node, transport.link, transport.peer, transport.auth, transport.tuning\n"
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
