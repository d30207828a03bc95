#!/usr/bin/env bash
# A short hash of the files a device call carries (pdserve/, scripts/, tests/ sources), so a
# call's output names the tree it ran: the device machine's `.git` copy can be older than the
# files that travelled, and its `git log` line then names a commit the call did not run.
# Run it here on the same checkout to compare:   bash scripts/tree_hash.sh
set -euo pipefail
cd "$(dirname "$0")/.."
find pdserve scripts tests -type f \( -name '*.py' -o -name '*.sh' \) -not -path '*/__pycache__/*' \
    | LC_ALL=C sort | xargs sha1sum | sha1sum | cut -c1-12
