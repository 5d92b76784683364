#!/usr/bin/env bash
# Quick start, command 1: set everything up, then run the main job.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
exec "$root/.venv/bin/meshd" demo "$@"
