"""The systemd unit and its GPU drop-in are valid (``systemd-analyze verify``) and ask for what meshd relies on."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tests.support.systemd import systemd_analyze
from tests.support.repo import ROOT

UNIT = ROOT / "systemd" / "meshd.service"


def _unit() -> configparser.ConfigParser:
    cp = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    cp.optionxform = str
    cp.read(UNIT)
    return cp


def test_the_unit_passes_systemd_analyze_verify(tmp_path):
    tool = systemd_analyze()
    if tool is None:
        pytest.skip("systemd-analyze is absent and could not be installed")
    # verify checks that ExecStart exists: point it at this environment's meshd.
    meshd = Path(sys.executable).with_name("meshd")
    exe = str(meshd) if meshd.exists() else f"{sys.executable} -m meshd"
    unit = tmp_path / "meshd.service"
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/meshd", exe))
    # and the GPU drop-in, where systemd (and verify) reads it: <unit>.d/
    shutil.copytree(UNIT.with_name("meshd.service.d"), tmp_path / "meshd.service.d")
    out = subprocess.run([tool, "verify", str(unit)], capture_output=True, text=True, timeout=120)
    complaints = [line for line in (out.stdout + out.stderr).splitlines() if "meshd.service" in line]
    assert out.returncode == 0 and not complaints, out.stdout + out.stderr


def test_the_unit_is_a_sandboxed_notify_service_with_a_watchdog():
    svc = _unit()["Service"]
    assert svc["Type"] == "notify"
    assert svc["ExecStart"].endswith("meshd join")
    assert svc["Restart"] == "on-failure"
    assert "WatchdogSec" in svc
    assert "TimeoutStartSec" in svc  # READY=1 waits for the model and a warm plan: longer than the default 90 s
    assert svc["ProtectSystem"] == "strict"
    for key in ("ProtectHome", "NoNewPrivileges", "PrivateTmp"):
        assert svc[key] == "yes", key
    assert set(svc["RestrictAddressFamilies"].split()) == {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"}
    # meshd finds its state and socket through these (meshd.config / meshd.paths)
    assert svc["StateDirectory"] == "meshd" and svc["RuntimeDirectory"] == "meshd"
    assert svc.get("User") or svc.get("DynamicUser") == "yes"
