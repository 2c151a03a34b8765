#!/usr/bin/env bash
# Set up, then run the test suite (ONNX conformance included, `slow` tests not). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Tests marked `slow` (the whole conformance lists, real models on lavapipe, tuning runs: the
# default run has a fixed subset of each) are left out here and in CI, which keeps CI under an
# hour on 2 cores; `bash scripts/test.sh -m slow` runs them (a later -m wins).
exec .venv/bin/python -m pytest -m "not slow" "$@"
