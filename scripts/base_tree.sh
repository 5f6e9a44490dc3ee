#!/usr/bin/env bash
# An older commit's tree as a folder for `scripts/gpu_check.sh compare`:
#   scripts/base_tree.sh 3899a47      -> .base/ (ignored by git; name it in the device call's carry)
set -euo pipefail
cd "$(dirname "$0")/.."
commit=${1:?usage: scripts/base_tree.sh COMMIT}
grep -qx '/.base/' .git/info/exclude 2>/dev/null || echo '/.base/' >> .git/info/exclude
rm -rf .base && mkdir .base
git archive "$commit" | tar -x -C .base
echo "$(git rev-parse --short "$commit")" > .base/COMMIT
echo ".base/ holds $(cat .base/COMMIT)"
