"""The integer kernels on GGUF blocks (``gguf_dot.cpp``: the K-quants and the entry points; ``small_dot.cpp``:
the 32-element types) and the layer's row steps (``row_ops.cpp``): built once with the system's C++ compiler,
loaded with ctypes.

Why compiled here rather than shipped: a few small sources, two builds (AVX2/FMA/F16C for x86 mini PCs and
laptops, a portable one that the compiler vectorises for ARM — with int8 dot products where the CPU has
them — and for older x86), and no build tool beyond ``g++``. ``scripts/setup.sh`` builds it into the
package directory; a process that finds no build there (another checkout, a changed source) builds into
``$MESHD_HOME/kernels`` on first use, a few seconds. The library is keyed by the source's hash, the
flags and the compiler, so a stale build is never loaded.

ctypes releases the GIL for the length of a call, so a stage's progress reporter keeps running during
a long product, and a product's rows are split over the library's own threads (``decode_step.cpp``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SOURCES = tuple(Path(__file__).with_name(f) for f in ("gguf_dot.cpp", "small_dot.cpp", "row_ops.cpp", "decode_step.cpp",
                                                     "group_sum.cpp"))
HEADERS = (Path(__file__).with_name("gguf_blocks.h"),)  # part of the build's key, not compiled on their own
PACKAGE_BUILD = Path(__file__).with_name("build")
COMMON_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off", "-fno-exceptions"]


class KernelUnavailable(RuntimeError):
    """No compiler, a failed build, or a CPU the builds do not serve: the integer mode is not offered."""


def cpu_flags() -> set[str]:
    """The kernel-relevant features this CPU reports (``partition.machine``: avx2, fma, f16c, the
    bfloat16 units, ARM's dot products...)."""
    from partition.machine import cpu_flags as relevant

    return set(relevant())


def variant() -> tuple[str, list[str]]:
    """(name, compiler flags) of the build this CPU runs: ``avx2`` or ``portable``.

    ``MESHD_KERNEL_ISA=portable`` forces the portable build (tests compare the two bit for bit)."""
    flags = cpu_flags()
    forced = os.environ.get("MESHD_KERNEL_ISA", "").strip().lower()
    machine = platform.machine().lower()
    if forced not in ("", "portable", "avx2"):
        raise KernelUnavailable(f"MESHD_KERNEL_ISA must be avx2 or portable, got {forced!r}")
    if forced != "portable" and machine in ("x86_64", "amd64") and {"avx2", "fma", "f16c"} <= flags:
        return "avx2", ["-mavx2", "-mfma", "-mf16c", "-DMESHD_AVX2"]
    if forced == "avx2":
        raise KernelUnavailable("MESHD_KERNEL_ISA=avx2 on a CPU without avx2, fma and f16c")
    if machine in ("aarch64", "arm64") and "asimddp" in flags:
        return "portable", ["-march=armv8.2-a+dotprod"]  # the compiler's int8 dot products (sdot)
    return "portable", []


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise KernelUnavailable("no C++ compiler found (install g++: apt-get install g++)")
    return cxx


def _library_name(cxx: str, name: str, flags: list[str]) -> str:
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelUnavailable(f"{cxx} does not run ({exc})") from exc
    key = hashlib.sha256(b"".join(s.read_bytes() for s in SOURCES + HEADERS) + " ".join(COMMON_FLAGS + flags).encode()
                         + version.encode())
    return f"gguf_dot-{name}-{key.hexdigest()[:16]}.so"


def build(directory: Path | None = None) -> Path:
    """The library for this CPU, built into ``directory`` unless a current build is there already."""
    name, flags = variant()
    cxx = _compiler()
    lib = _library_name(cxx, name, flags)
    dirs = [directory] if directory else [PACKAGE_BUILD, _home_dir()]
    for d in dirs:
        if (d / lib).is_file():
            return d / lib
    for d in dirs:
        try:
            d.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=d)
        except OSError:
            continue  # a read-only install: the next place
        os.close(fd)
        cmd = [cxx, *COMMON_FLAGS, *flags, *map(str, SOURCES), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            os.unlink(tmp)
            raise KernelUnavailable(f"building the kernels failed: {' '.join(cmd)}\n{done.stderr[-2000:]}")
        os.replace(tmp, d / lib)  # atomic: concurrent builders (test workers) never load half a file
        for old in d.glob(f"gguf_dot-{name}-*.so"):  # builds of older sources (a process using one keeps it)
            if old.name != lib:
                old.unlink(missing_ok=True)
        return d / lib
    raise KernelUnavailable(f"no writable place to build the kernels ({', '.join(map(str, dirs))})")


def _home_dir() -> Path:
    env = os.environ.get("MESHD_HOME")
    return (Path(env).expanduser() if env else Path.home() / ".cache" / "meshd") / "kernels"


#: decode_step.cpp's ``ReduceFn``: a tensor-parallel member's partial sum (ctx, float*, n) summed over its group
#: in place; returns non-zero when the group failed. ``group_sum.cpp``'s ``meshd_group_sum`` is one (its ctx a
#: :class:`GroupSum`); a Python callback is the other (ctx null).
REDUCE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)

_LIB: ctypes.CDLL | None = None
_ERROR: str = ""
_LOCK = threading.Lock()
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


def library() -> ctypes.CDLL:
    """The loaded kernels (built on first use); raises :class:`KernelUnavailable` with the reason."""
    global _LIB, _ERROR
    with _LOCK:
        if _LIB is None and not _ERROR:
            try:
                lib = ctypes.CDLL(str(build()))
            except (KernelUnavailable, OSError) as exc:
                _ERROR = str(exc)
            else:
                lib.meshd_quantize_rows.argtypes = [_ptr, _i64, _i64, _i64, ctypes.c_int, _ptr, _ptr, _ptr]
                lib.meshd_quantize_rows.restype = ctypes.c_int
                lib.meshd_gguf_matmul.argtypes = [ctypes.c_int, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr,
                                                  _i64, _ptr, _i64, _ptr, _i64]
                lib.meshd_gguf_matmul.restype = ctypes.c_int
                lib.meshd_linear.argtypes = [ctypes.c_int, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _ptr, _i64, _i64,
                                             _i64, _ptr, _i64]
                lib.meshd_linear.restype = ctypes.c_int
                lib.meshd_rms_norm.argtypes = [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, ctypes.c_float]
                lib.meshd_rope.argtypes = [_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr]
                lib.meshd_row_attention.argtypes = [_ptr, _i64, _i64, _i64, ctypes.c_float, _ptr, _ptr, ctypes.c_int]
                lib.meshd_linear_threads.argtypes = [_ptr, _ptr, _i64, _i64, _ptr, _i64, ctypes.c_int]
                lib.meshd_swiglu.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _i64]
                lib.meshd_decode_layers.argtypes = [
                    ctypes.c_int, _ptr, ctypes.c_float, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, ctypes.c_float,
                    _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, ctypes.c_int, REDUCE_FN, _ptr,
                    REDUCE_FN, _ptr, _ptr]
                lib.meshd_decode_layers.restype = ctypes.c_int
                lib.meshd_group_sum.argtypes = [_ptr, _ptr, _i64]
                lib.meshd_group_sum.restype = ctypes.c_int
                for f in ("meshd_rms_norm", "meshd_rope", "meshd_row_attention", "meshd_linear_threads",
                          "meshd_swiglu"):
                    getattr(lib, f).restype = None
                for f in ("meshd_block_bytes", "meshd_block_elems", "meshd_act_block"):
                    getattr(lib, f).argtypes = [ctypes.c_int]
                _LIB = lib
        if _LIB is None:
            raise KernelUnavailable(_ERROR)
        return _LIB


def available() -> tuple[bool, str]:
    """(the kernels load on this machine, why not)."""
    try:
        library()
    except KernelUnavailable as exc:
        return False, str(exc)
    return True, ""


def isa() -> str:
    """The build in use: ``avx2`` or ``portable``."""
    return "avx2" if library().meshd_kernel_isa() == 2 else "portable"


#: GGUF tensor types the kernels multiply on their own blocks (ggml's type numbers).
TYPE_IDS = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}


#: The activation block each weight type pairs with: llama.cpp's Q8_0 (32) or Q8_K (256).
ACT_BLOCK = {name: 256 if name.endswith("_K") else 32 for name in TYPE_IDS}


@dataclass(frozen=True)
class QuantizedRows:
    """Activation rows [M, K] as the kernels read them: int8 codes, a scale per ``block``, sums per 16."""

    q: np.ndarray  # int8 [M, K]
    d: np.ndarray  # float32 [M, K / block]
    s: np.ndarray  # int16 [M, K / 16]
    block: int

    @property
    def rows(self) -> int:
        return self.q.shape[0]


def quantize_rows(x: np.ndarray, block: int = 32) -> QuantizedRows:
    """``x`` float32 [M, K] (K a multiple of ``block``) quantised per row and ``block`` (32 or 256)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    m, k = x.shape
    if block not in (32, 256) or k % block:
        raise ValueError(f"activations are quantised in blocks of 32 or 256 dividing their {k} columns, not {block}")
    q = np.empty((m, k), np.int8)
    d = np.empty((m, k // block), np.float32)
    s = np.empty((m, k // 16), np.int16)
    library().meshd_quantize_rows(x.ctypes.data, m, k, k, block, q.ctypes.data, d.ctypes.data, s.ctypes.data)
    return QuantizedRows(q, d, s, block)


def matmul_into(out: np.ndarray, x: QuantizedRows, type_name: str, blocks: np.ndarray, cols: int,
                rows: tuple[int, int] | None = None, colmap: np.ndarray | None = None, col0: int = 0) -> None:
    """``out[:, col0 + colmap[n]] = x @ w[n]`` for the weight rows ``rows`` (default: all) of ``blocks``
    (uint8 [N, bytes per row], a GGUF tensor's data as the file holds it). ``out``: float32 [M, ldo]."""
    lib = library()
    if x.block != ACT_BLOCK[type_name]:
        raise ValueError(f"{type_name} weights pair with activations in blocks of {ACT_BLOCK[type_name]}, not {x.block}")
    n = blocks.shape[0]
    n0, n1 = rows or (0, n)
    if out.dtype != np.float32 or not out.flags.c_contiguous or out.shape[0] != x.rows:
        raise ValueError("out must be C-contiguous float32 with a row per activation row")
    if colmap is not None and (colmap.dtype != np.int64 or not colmap.flags.c_contiguous):
        raise ValueError("colmap must be contiguous int64")
    rc = lib.meshd_gguf_matmul(TYPE_IDS[type_name], blocks.ctypes.data, blocks.strides[0], n0, n1, cols,
                               x.q.ctypes.data, x.d.ctypes.data, x.s.ctypes.data, x.rows, out.ctypes.data,
                               out.shape[1], None if colmap is None else colmap.ctypes.data, col0)
    if rc:
        raise ValueError(f"the kernels do not multiply {type_name} blocks")


class MatrixSpec(ctypes.Structure):
    """decode_step.cpp's ``Matrix``: a :class:`FusedMatrices`' parts as pointers."""

    _fields_ = [("nparts", ctypes.c_int), ("types", _ptr), ("w", _ptr), ("row_bytes", _ptr), ("rows", _ptr),
                ("colmaps", _ptr), ("n_out", _i64), ("k", _i64)]


class SegmentSpec(ctypes.Structure):
    """decode_step.cpp's ``Segments``: where one layer's keys and values of a sequence lie."""

    _fields_ = [("n", ctypes.c_int), ("keys", _ptr), ("values", _ptr), ("lengths", _ptr), ("head_strides", _ptr)]


class DecodeLayerSpec(ctypes.Structure):
    """decode_step.cpp's ``DecodeLayer``: one layer's matrices (MatrixSpec addresses), biases and norms."""

    _fields_ = [("qkv", _ptr), ("qkv_bias", _ptr), ("o", _ptr), ("gate_up", _ptr), ("down", _ptr),
                ("attn_norm", _ptr), ("mlp_norm", _ptr)]


#: the most members a native group sum serves (group_sum.cpp's MAX_PEERS + 1)
GROUP_SUM_MAX_MEMBERS = 16


class GroupSumPeer(ctypes.Structure):
    """group_sum.cpp's ``PeerStream``: one other member's stream (its socket, the two secretstream states)."""

    _fields_ = [("rank", ctypes.c_int32), ("fd", ctypes.c_int32), ("push_state", _ptr), ("pull_state", _ptr)]


class GroupSum(ctypes.Structure):
    """group_sum.cpp's ``GroupSum``: what ``meshd_group_sum`` needs to sum a partial over the group itself."""

    _fields_ = [("spin_s", ctypes.c_double), ("last_wait_s", ctypes.c_double), ("slice_ms", ctypes.c_int32),
                ("rank", ctypes.c_int32), ("size", ctypes.c_int32), ("npeers", ctypes.c_int32),
                ("abort", ctypes.c_int32), ("pass_", ctypes.c_uint32), ("exchange", ctypes.c_uint32),
                ("seal", _ptr), ("open", _ptr), ("check", _ptr),
                ("peers", GroupSumPeer * (GROUP_SUM_MAX_MEMBERS - 1)), ("error", ctypes.c_char * 256)]


#: group_sum.cpp's ``CheckFn``: non-zero when the group is lost (asked while a wait is blocked)
GROUP_CHECK_FN = ctypes.CFUNCTYPE(ctypes.c_int)


def group_sum_reducer() -> "REDUCE_FN":
    """``meshd_group_sum`` as the decode kernel's reducer (its ctx a :class:`GroupSum`)."""
    return REDUCE_FN(ctypes.cast(library().meshd_group_sum, ctypes.c_void_p).value)


class FusedMatrices:
    """Several GGUF matrices side by side (their rows concatenated), prepared for one kernel call per
    product: the pointers and shapes are fixed once, so a decode step pays one short foreign call per
    layer's product rather than a Python loop over its parts."""

    def __init__(self, parts: list[tuple[str, np.ndarray, np.ndarray | None]], cols: int):
        lib = library()
        self._keep = [(blocks, colmap) for _, blocks, colmap in parts]  # the arrays the pointers point into
        for name, blocks, colmap in parts:
            if name not in TYPE_IDS:
                raise ValueError(f"the kernels do not multiply {name} blocks")
            if blocks.ndim != 2 or blocks.strides[1] != 1 or blocks.dtype != np.uint8:
                raise ValueError("blocks must be uint8 [rows, bytes per row] with contiguous rows")
            if colmap is not None and (colmap.dtype != np.int64 or not colmap.flags.c_contiguous):
                raise ValueError("colmap must be contiguous int64")
        n = len(parts)
        self.cols = cols
        self.rows = sum(int(b.shape[0]) for _, b, _ in parts)
        self._types = (ctypes.c_int * n)(*(TYPE_IDS[t] for t, _, _ in parts))
        self._ptrs = (ctypes.c_void_p * n)(*(b.ctypes.data for _, b, _ in parts))
        self._row_bytes = (ctypes.c_int64 * n)(*(b.strides[0] for _, b, _ in parts))
        self._rows = (ctypes.c_int64 * n)(*(b.shape[0] for _, b, _ in parts))
        self._maps = (ctypes.c_void_p * n)(*(None if m is None else m.ctypes.data for _, _, m in parts))
        #: the matrices as one C struct, as every product and the decode step's kernels take them
        self.spec = MatrixSpec(n, ctypes.cast(self._types, _ptr), ctypes.cast(self._ptrs, _ptr),
                               ctypes.cast(self._row_bytes, _ptr), ctypes.cast(self._rows, _ptr),
                               ctypes.cast(self._maps, _ptr), self.rows, cols)
        self._spec_ref = ctypes.byref(self.spec)
        self._call = lib.meshd_linear_threads

    def run(self, x_ptr: int, m: int, ldx: int, out_ptr: int, ldo: int, threads: int = 1) -> None:
        """out (float32 [m, ldo]) = x (float32 [m, cols], row stride ``ldx``) @ every row.T, the output rows
        split over ``threads`` of the kernels' own pool (the GIL let go for the call)."""
        self._call(self._spec_ref, x_ptr, m, ldx, out_ptr, ldo, threads)

