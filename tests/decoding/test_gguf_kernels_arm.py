"""The ARM builds of the integer kernels give the x86 builds' bits: an ARM board and an x86 mini PC in one
mesh compute one answer. Run under emulation (qemu-aarch64) where the cross compiler and qemu are installed
(Debian: ``apt-get install g++-aarch64-linux-gnu qemu-user``); skipped elsewhere."""

import shutil
import subprocess
from pathlib import Path

import pytest

from decoding.quant import native

CROSS = shutil.which("aarch64-linux-gnu-g++")
QEMU = shutil.which("qemu-aarch64")
HOST = shutil.which("g++") or shutil.which("c++")
HARNESS = Path(__file__).resolve().parents[1] / "support" / "kernel_bits.cpp"
# what a build links: the library's flags but as a program (the harness has main)
FLAGS = [f for f in native.COMMON_FLAGS if f not in ("-shared", "-fPIC")] + ["-pthread"]


def bits(cxx: str, flags: list[str], out: Path, runner: list[str]) -> list[str]:
    subprocess.run([cxx, *FLAGS, *flags, *map(str, native.SOURCES), str(HARNESS), "-o", str(out)],
                   check=True, capture_output=True, timeout=600)
    done = subprocess.run([*runner, str(out)], check=True, capture_output=True, text=True, timeout=600)
    lines = done.stdout.splitlines()
    assert len(lines) > 100  # every type, width and row count printed
    # each case printed its own bits (no case degenerate, e.g. all zeros, so equality means something)
    assert len({line.split()[-1] for line in lines}) == len(lines)
    return lines


@pytest.mark.skipif(not (CROSS and QEMU and HOST), reason="no aarch64 cross compiler and qemu-aarch64")
def test_arm_builds_with_and_without_int8_dot_products_give_the_x86_bits(tmp_path):
    host = bits(HOST, native.variant()[1], tmp_path / "host", [])
    # what a Raspberry Pi 5 or a Jetson Orin runs (sdot), and an ARM CPU without dot products
    dotprod = bits(CROSS, ["-static", "-march=armv8.2-a+dotprod"], tmp_path / "arm-dotprod", [QEMU, "-cpu", "max"])
    plain = bits(CROSS, ["-static", "-march=armv8-a"], tmp_path / "arm", [QEMU, "-cpu", "max"])
    assert dotprod == host
    assert plain == host
