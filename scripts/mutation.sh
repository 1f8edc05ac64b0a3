#!/bin/sh
# Mutation score of the engine (not part of CI: a sample of 200 takes about half an hour).
# Runs scripts/mutation.py from the repository root, niced: the machine's cores are shared.
# Examples:
#   scripts/mutation.sh --list
#   scripts/mutation.sh --sample 200 --seed 1 --report /tmp/mutation.json
set -eu
cd "$(dirname "$0")/.."
exec nice -n 10 python scripts/mutation.py "$@"
