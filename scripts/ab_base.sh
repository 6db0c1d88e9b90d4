#!/usr/bin/env bash
# Puts the source of a commit into .carry/base, for the GPU check's `abbuild` and `ab` steps: the
# layer timed on that commit and on the working tree in the same call, rounds interleaved.
#   scripts/ab_base.sh HEAD~1      then, on the GPU machine:
#   scripts/gpu_check.sh build abbuild ab
# The GPU machine gets no git history, so the base travels as files in the carried .carry folder.
set -euo pipefail
cd "$(dirname "$0")/.."
commit=$(git rev-parse --verify "${1:?usage: scripts/ab_base.sh COMMIT}^{commit}")
rm -rf .carry/base
mkdir -p .carry/base
git archive "$commit" -- . ':!bench/results' | tar -x -C .carry/base
echo "$commit" >.carry/base/.ab_commit
echo "base $(git log -1 --format='%h %s' "$commit" | cut -c1-100) in .carry/base ($(du -sh .carry/base | cut -f1))"
