#!/usr/bin/env bash
# Quick start, command 2: the whole test suite (the command CI runs).
# pytest exits 5 when it collects nothing; that is a failure here, as is any other non-zero code.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh" --with-tool-model
cd "$root"
# With no arguments: 4 workers (the suite is written for it: no shared ports, dirs or sleeps) so the
# whole suite stays well under CI's budget on 2 cores; any arguments go to pytest as given.
if [ $# -eq 0 ]; then set -- -n 4; fi
exec .venv/bin/python -m pytest "$@"
