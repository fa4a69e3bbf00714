#!/usr/bin/env bash
# Sets up .venv with the dev extras and runs the test suite (Triton kernels under the CPU interpreter).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev || exit 1
# Test files run on MINI_INFER_TEST_WORKERS processes (pytest-xdist; default 2, the CI machine's cores: the suite
# took 18m41s in one process on 2 cores, 10m57s on two with --dist loadfile, 12m05s for .ci/run on a clean clone
# with the set-up; 2,564 tests in 11m15s on two, .ci/run on a clean clone 13m41s with the set-up, 2026-11-25;
# with the SmolLM2 files as one unit and the slowest units first (tests/conftest.py), 2,547 passed in 10m01s
# where the same machine ran the suite before it in 11m13s; at 9bacde5, 2,558 passed in 10m48s with setup.sh,
# the last minutes beside another run, 2026-11-25; .ci/run on a clean clone 14m35s at 6fb3898, 15m06s at 5fab1b7
# (three tests made cheaper; the machine's speed moves by a minute between runs), 13m40s at a42afa4 (the compile
# cache no longer missing between engines and direct compiles), 2026-11-30);
# 0 runs everything in this process.
workers="${MINI_INFER_TEST_WORKERS:-2}"
if [ "$workers" = "0" ]; then
  .venv/bin/python -m pytest "$@"
else
  .venv/bin/python -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
fi
rc=$?
if [ $rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi
exit $rc
