#!/usr/bin/env bash
# The test suite against the oldest transformers pyproject.toml allows (5.17.0, also the GPU image's release) instead
# of the newest one scripts/setup.sh installs: its configs and modeling code differ (tensor-parallel plan entries, the
# MoE routing's ops), and only the GPU machine ran it before. Not CI (it doubles the suite's time): run it when a
# change touches model loading, capture or the passes' matching. Arguments go to pytest (scripts/test.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev || exit 1
dir=.oldest-transformers
.venv/bin/python -m pip install -q --no-deps --upgrade --target "$dir" transformers==5.17.0 huggingface-hub==1.33.0 \
  || exit 1
PYTHONPATH="$PWD/$dir" bash scripts/test.sh "$@"
