#!/usr/bin/env bash
# Set up, then run the whole test suite (ONNX conformance included). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
