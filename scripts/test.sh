#!/usr/bin/env bash
# Quick start, command 2: the whole test suite (the command CI runs).
# pytest exits 5 when it collects nothing; that is a failure here, as is any other non-zero code.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
exec .venv/bin/python -m pytest "$@"
