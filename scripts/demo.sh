#!/usr/bin/env bash
# Set up, then compile the bundled example model, check it against onnxruntime and time it.
# Extra arguments go to `gimlet-tvm demo` (e.g. --model resnet_cnn --batch 8).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/gimlet-tvm demo "$@"
