#!/usr/bin/env bash
# Issue #47's before/after check: each benchmark's --quick run on the base (154331a, a worktree at
# /work/base) and on the refactored tree, interleaved (before, after, per benchmark), on a quiet machine.
#   bash bench/results/issue47/ab.sh [ROUND]      raw output in bench/results/issue47/<bench>-<side>-r<ROUND>.txt
set -uo pipefail
round="${1:-1}"
out="$(cd "$(dirname "$0")" && pwd)"
py=/work/main/.venv/bin/python
after="${AFTER:-/work/main}"  # the refactored tree (a worktree of it, so edits meanwhile do not change what runs)
run() {  # side dir bench args...
  local side=$1 dir=$2 name=$3; shift 3
  local t0=$SECONDS
  (cd "$dir" && PYTHONPATH="$dir" timeout -k 10 900 "$py" "bench/$name.py" "$@") \
    >"$out/$name-$side-r$round.txt" 2>&1
  echo "$name $side rc=$? $((SECONDS - t0))s"
}
for b in decode concurrency pipeline soak share home_assistant; do
  run before /work/base "$b" --quick --json
  run after "$after" "$b" --quick --json
done
