"""The systemd install works end to end, as ``systemd/README.md`` documents it.

``systemd/install.sh`` runs in its ``--prefix`` mode (everything under a
temporary root, as this user: no ``meshd`` user, nothing started) against a
wheel built from this tree and a fresh virtual environment. Then: the
installed meshd finds its reference profiles without a repository around it,
the key the script printed is checked by the daemon the installed unit
starts (same state directory), that daemon sends ``READY=1`` and answers,
the unit and the GPU drop-in pass ``systemd-analyze verify``, and the docs
name what the script does.

The venv sees this environment's dependencies through a ``.pth`` file (no
torch download); meshd itself is the wheel's copy (``--force-reinstall``).
"""

from __future__ import annotations

import configparser
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from meshd.apikeys import ApiKeyStore
from meshd.client import MeshdClient
from meshd.config import load_config
from tests.support.daemons import FAST, FAST_ENV
from tests.support.waiting import wait_until
from tests.support.systemd import systemd_analyze
from tests.support.repo import ROOT

pytestmark = pytest.mark.slow

SYSTEMD = ROOT / "systemd"
SCRIPT = SYSTEMD / "install.sh"
DOCS = SYSTEMD / "README.md"


def _tree_files() -> list[str]:
    """The files a fresh clone of this working tree has (tracked and new, not ignored)."""
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, timeout=60)
    if out.returncode != 0:
        pytest.skip("not a git checkout: cannot tell the tree's files from build outputs")
    return [f for f in out.stdout.decode().split("\0") if f and os.path.lexists(ROOT / f)]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """``pip wheel --no-deps`` of a copy of this tree (symbolic links kept, as git keeps them)."""
    pytest.importorskip("setuptools", minversion="77")  # the build backend pyproject.toml names
    base = tmp_path_factory.mktemp("wheel")
    src = base / "src"
    for rel in _tree_files():
        dest = src / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / rel).is_symlink():
            dest.symlink_to(os.readlink(ROOT / rel))
        else:
            shutil.copy2(ROOT / rel, dest)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                          "--disable-pip-version-check", "-q", "-w", str(base / "dist"), str(src)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    (found,) = (base / "dist").glob("meshd-*.whl")
    return found


@dataclass(frozen=True)
class Installed:
    prefix: Path
    venv: Path
    output: str  # what install.sh printed

    @property
    def home(self) -> Path:
        return self.prefix / "var/lib/meshd"

    @property
    def unit(self) -> Path:
        return self.prefix / "etc/systemd/system/meshd.service"

    def service(self) -> configparser.SectionProxy:
        cp = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
        cp.optionxform = str
        cp.read(self.unit)
        return cp["Service"]

    def service_env(self) -> dict[str, str]:
        """What systemd gives the daemon: the unit's Environment= and its state directory."""
        env = dict(kv.split("=", 1) for kv in _all_values(self.unit, "Environment"))
        env["STATE_DIRECTORY"] = str(self.home)  # StateDirectory=meshd, under the prefix
        return env

    def key(self) -> str:
        (key,) = re.findall(r"^(meshd-[A-Za-z0-9_-]{43})$", self.output, re.M)
        return key


def _all_values(unit: Path, name: str) -> list[str]:
    """Every value of a repeatable key (configparser keeps the last one only)."""
    return [line.split("=", 1)[1].strip() for line in unit.read_text().splitlines()
            if line.startswith(name + "=")]


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith("MESHD_") and k not in ("PYTHONPATH", "NOTIFY_SOCKET", "WATCHDOG_USEC",
                                                        "WATCHDOG_PID", "STATE_DIRECTORY", "RUNTIME_DIRECTORY",
                                                        "JOURNAL_STREAM")}


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Installed:
    prefix = tmp_path_factory.mktemp("root")
    venv = prefix / "opt/meshd"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    purelib = subprocess.run([str(venv / "bin/python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    # torch & co. (and pip) from this environment; meshd from the wheel, in the venv's own site-packages
    (Path(purelib) / "zz-meshd-test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    models = tmp_path_factory.mktemp("models")
    (models / "other.gguf").write_bytes(b"GGUF" + bytes(60))
    out = subprocess.run(
        ["bash", str(SCRIPT), "--prefix", str(prefix), "--source", str(wheel),
         "--pip-args", "--no-deps --no-index --force-reinstall",
         "--new-home", "flat", "--name", "kitchen", "--key", "ha", "--http", "0.0.0.0:0", "--gpu",
         "--model-from", str(models)],
        capture_output=True, text=True, cwd="/", env=_clean_env(), timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    return Installed(prefix, venv, out.stdout)


def test_the_wheel_ships_the_reference_profiles(wheel):
    with zipfile.ZipFile(wheel) as z:
        shipped = {Path(n).name: z.read(n) for n in z.namelist() if n.startswith("meshd/profiles/")}
    source = {p.name: p.read_bytes() for p in (ROOT / "profiles").glob("*.json")}
    assert source and shipped == source


def test_the_installed_meshd_finds_its_profiles_without_the_repository(installed):
    probe = ("import meshd, meshd.mesh.home_plan as p; d = p.default_profile(); "
             "print(meshd.__file__); print(p.shipped_profiles_dir()); print(d['device_id'] if d else None)")
    out = subprocess.run([str(installed.venv / "bin/python"), "-c", probe], capture_output=True, text=True,
                         cwd="/", env=_clean_env(), timeout=120)
    module, profiles, device = out.stdout.split()
    assert Path(module).is_relative_to(installed.venv) and Path(profiles).is_relative_to(installed.venv)
    assert device != "None"


def test_the_key_models_and_home_land_where_the_service_reads_them(installed):
    env = installed.service_env()
    assert env["MESHD_HOME"] == str(installed.home)
    state = load_config(None, env).resolved_state_dir(env)
    assert state == installed.home
    assert json.loads((state / "home.json").read_text())["name"] == "flat"
    assert ApiKeyStore(state).check(installed.key()).name == "ha"
    listed = subprocess.run([str(installed.prefix / "usr/local/bin/meshd"), "model", "list", "--json"],
                            capture_output=True, text=True, cwd="/", timeout=120,
                            env={**_clean_env(), "MESHD_HOME": env["MESHD_HOME"]})
    assert [m["name"] for m in json.loads(listed.stdout)["models"]] == ["other.gguf"]
    doc = installed.service().parser["Unit"]["Documentation"]
    assert doc.startswith("file://") and (installed.prefix / doc.removeprefix("file:///")).is_file()


def test_the_installed_unit_and_its_gpu_drop_in_pass_systemd_analyze_verify(installed):
    drop_in = installed.unit.parent / "meshd.service.d/gpu.conf"
    assert drop_in.read_text() == (SYSTEMD / "meshd.service.d/gpu.conf").read_text()
    tool = systemd_analyze()
    if tool is None:
        pytest.skip("systemd-analyze is absent and could not be installed")
    out = subprocess.run([tool, "verify", str(installed.unit)], capture_output=True, text=True, timeout=120)
    complaints = [line for line in (out.stdout + out.stderr).splitlines() if "meshd.service" in line]
    assert out.returncode == 0 and not complaints, out.stdout + out.stderr


class Service:
    """The daemon started as systemd starts the installed unit: its ExecStart, its Environment=,
    $STATE_DIRECTORY, $RUNTIME_DIRECTORY and a $NOTIFY_SOCKET this test reads."""

    def __init__(self, installed: Installed, run: Path, **extra_env: str):
        self.run = run
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(run / "notify"))
        self.notify.settimeout(0.5)
        self.received: list[str] = []
        env = {**_clean_env(), **FAST_ENV, **installed.service_env(),
               "RUNTIME_DIRECTORY": str(run), "NOTIFY_SOCKET": str(run / "notify"),
               "MESHD_CONFIG": str(installed.prefix / "etc/meshd/meshd.toml"),  # the real one: /etc/meshd/meshd.toml
               # what a test needs on top (a drop-in could set these): free ports, loopback
               "MESHD_PORT": "0", "MESHD_PAIRING_PORT": "0", "MESHD_INTERFACE": "127.0.0.1", **extra_env}
        self.log = open(run / "daemon.log", "wb")
        self.proc = subprocess.Popen([*shlex.split(installed.service()["ExecStart"]), *FAST], env=env, cwd="/",
                                     stdout=self.log, stderr=subprocess.STDOUT)

    def said(self, what, running: bool = True) -> bool:
        """Whether a notification ``what`` (a line, or a predicate on one) arrived; reads one datagram."""
        assert not running or self.proc.poll() is None, (self.run / "daemon.log").read_text()
        try:
            self.received.extend(self.notify.recv(4096).decode().splitlines())
        except TimeoutError:
            pass
        return any(what(line) if callable(what) else line == what for line in self.received)

    def wait_said(self, what, timeout: float, running: bool = True) -> None:
        wait_until(lambda: self.said(what, running), timeout, what=f"{what} from the installed service",
                   explain=lambda: f"{self.received}\n{(self.run / 'daemon.log').read_text()}")

    def stop(self) -> int:
        """SIGTERM, as ``systemctl stop`` sends it; the exit code, after STOPPING=1."""
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(30)
        self.wait_said("STOPPING=1", 10, running=False)
        return code

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()
        self.notify.close()


def test_the_service_as_installed_sends_ready_and_admits_the_scripts_key(installed, tmp_path_factory):
    svc = Service(installed, tmp_path_factory.mktemp("run"), MESHD_MODEL="none")  # no model to load
    try:
        svc.wait_said("READY=1", 60)
        status = MeshdClient(svc.run / "meshd.sock", timeout=10).status()  # $RUNTIME_DIRECTORY/meshd.sock
        assert status["name"] == "kitchen"
        url = "http://127.0.0.1:" + status["api"]["http"].rpartition(":")[2]
        assert httpx.get(f"{url}/api/tags", timeout=10).status_code == 401
        ok = httpx.get(f"{url}/api/tags", headers={"Authorization": f"Bearer {installed.key()}"}, timeout=10)
        assert ok.status_code == 200 and ok.json() == {"models": []}, ok.text  # admitted; no model here
        assert svc.stop() == 0
    finally:
        svc.close()


def test_a_service_without_the_model_says_in_its_status_what_it_waits_for(installed, tmp_path_factory):
    """The install copied no default model: not READY, and `systemctl status` says why and what helps."""
    svc = Service(installed, tmp_path_factory.mktemp("run"))
    try:
        svc.wait_said(lambda line: line.startswith("STATUS=") and "fetching the model" in line
                      and "meshd model pull" in line, 60)
        assert "READY=1" not in svc.received
        assert svc.stop() == 0
    finally:
        svc.close()


def test_the_docs_name_every_option_of_the_script_and_the_drop_in_as_shipped():
    docs = DOCS.read_text()
    options = set(re.findall(r"^  (--[a-z-]+)", SCRIPT.read_text(), re.M))
    assert options and not {o for o in options if o not in docs}
    gpu = (SYSTEMD / "meshd.service.d/gpu.conf").read_text()
    settings = gpu[gpu.index("[Service]"):].strip()
    assert settings in docs
    # every one-off command as the service's user names the service's MESHD_HOME
    for line in docs.splitlines():
        if "sudo -u meshd" in line:
            assert "MESHD_HOME=/var/lib/meshd" in line, line
    unit = (SYSTEMD / "meshd.service").read_text()
    timeout = re.search(r"^TimeoutStartSec=(\S+)", unit, re.M).group(1)
    assert f"TimeoutStartSec={timeout}" in docs
