#!/usr/bin/env bash
# Sets up .venv with the dev extras and runs the test suite (Triton kernels under the CPU interpreter).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev || exit 1
.venv/bin/python -m pytest "$@"
rc=$?
if [ $rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi
exit $rc
