#!/usr/bin/env bash
# Set up, then run the test suite (ONNX conformance included, `slow` tests not). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Tests marked `slow` (real models run for minutes on lavapipe) are left out here and in CI;
# `bash scripts/test.sh -m slow` runs them (a later -m wins).
exec .venv/bin/python -m pytest -m "not slow" "$@"
