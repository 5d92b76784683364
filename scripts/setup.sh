#!/usr/bin/env bash
# Idempotent set-up: .venv in the repo root, pinned CPU torch, meshd (editable)
# with its test extras, and the embedded default model in the model cache.
# Re-running is cheap: the install is skipped while pyproject/constraints are unchanged.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    echo "[setup] creating .venv"
    "$py" -m venv .venv
fi
stamp=".venv/.meshd-install-stamp"
want="$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "[setup] installing dependencies (torch pinned by constraints.txt)"
    log=".venv/install.log"
    if ! { .venv/bin/python -m pip install --upgrade pip &&
           .venv/bin/python -m pip install -c constraints.txt -e ".[test,bench]"; } >"$log" 2>&1; then
        tail -40 "$log"
        echo "[setup] dependency installation failed (full log: $log)" >&2
        exit 1
    fi
    echo "$want" > "$stamp"
fi
# The gguf numeric mode's kernels (C++, a few seconds with g++): built now so the first request does
# not wait for them; a machine without a compiler serves in another mode and says why.
.venv/bin/python -m decoding.quant.native || echo "[setup] warning: the integer kernels did not build" \
    "(install g++); meshd will serve in the packed or float32 mode"
# meshd's own modules as bytecode now (an editable install leaves them as source): a daemon that
# cannot write bytecode (PYTHONDONTWRITEBYTECODE, a read-only checkout) compiles them on every
# start, ~1 s of a one-core device's restart.
.venv/bin/python -m compileall -q -j 0 meshd transport partition decoding profiles >/dev/null \
    || echo "[setup] warning: could not precompile meshd's modules; starts will compile them"
.venv/bin/meshd model pull --quiet
# The tool-calling model for the Home Assistant tests (~490 MB, fetched once, sha256-checked): only
# for the test command (`setup.sh --with-tool-model`), never for the demo. Those tests skip with the
# reason if it is missing; MESHD_SKIP_TOOL_MODEL=1 skips the fetch.
if [ "${1:-}" = "--with-tool-model" ] && [ -z "${MESHD_SKIP_TOOL_MODEL:-}" ]; then
    if ! .venv/bin/meshd model list 2>/dev/null | grep -qE "^ +qwen2.5-coder-0.5b-instruct +cached"; then
        echo "[setup] fetching qwen2.5-coder-0.5b-instruct (~490 MB, once) for the tool-calling tests;" \
             "MESHD_SKIP_TOOL_MODEL=1 skips it (those tests then skip)"
    fi
    .venv/bin/meshd model pull qwen2.5-coder-0.5b-instruct --quiet \
        || echo "[setup] warning: could not fetch qwen2.5-coder-0.5b-instruct; the tool-calling tests will skip"
fi
