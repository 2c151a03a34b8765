"""Prepare a GPU check for a device machine that cannot install packages: the runtime bundle,
suite models compiled here for the GPU targets (and the CPU, which checks the bundle itself),
their inputs and onnxruntime's outputs, and check.py, which runs them there.

    .venv/bin/python benchmarks/gpu_bundle.py prepare out/gpu [--targets cuda llvm]
        [--models resnet_cnn ...] [--arch sm_90] [--cpu x86-64-v3]
    # on the device, with out/gpu carried over:
    python3 out/gpu/check.py [--repeat 50]

Everything is written under OUT_DIR, which must stay under 64 MiB (what the device machine
takes per call): the bundle is ~39 MiB, so the default models are the small ones (the MLP's
weights alone are 100 MB).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

import gimlet_tvm
from gimlet_tvm.errors import GimletError
from gimlet_tvm.models import SUITE
from gimlet_tvm.peers import onnxruntime_session
from gimlet_tvm.runtime_bundle import make_bundle, size_of

MAX_BYTES = 64 * 2**20
CHECK_SCRIPT = Path(__file__).with_name("gpu_bundle_check.py")
MODELS = ["resnet_cnn", "mobilenet_cnn", "transformer_encoder"]
BATCH = {"mlp": 32, "resnet_cnn": 8, "mobilenet_cnn": 8, "transformer_encoder": 8}
TOLERANCE = {"llvm": 1e-4, "cuda": 1e-3, "vulkan": 1e-3}
"""GPU math differs from the CPU's in the last bits (as in benchmarks/gpu_check.py)."""


def target_of(name: str, arch: str, cpu: str) -> str | dict:
    """The build target for a target name, for the device rather than this machine: CUDA for
    its `arch` (no GPU here to ask), the CPU for `cpu` (an LLVM CPU name)."""
    if name == "cuda":
        return {"kind": "cuda", "arch": arch}
    return {"kind": "llvm", "mcpu": cpu} if name == "llvm" else name


def prepare(out: Path, targets: list[str], models: list[str], arch: str,
            cpu: str = "x86-64-v3", python_versions: tuple[str, ...] = ()) -> list[dict]:
    """Write the bundle (with extensions for `python_versions` too), artifacts, the ONNX models
    (onnxruntime is the peer where the device has it), inputs, reference outputs, manifest.json
    and check.py to `out`; returns the manifest's entries. Fails if `out` would exceed 64 MiB."""
    make_bundle(out / "runtime", python_versions)
    (out / "artifacts").mkdir()
    (out / "data").mkdir()
    entries = []
    for name in models:
        proto = SUITE[name].build()
        inputs = SUITE[name].example_inputs(batch=BATCH.get(name, 1))
        names = [output.name for output in proto.graph.output]
        reference = dict(zip(names, onnxruntime_session(proto, threads=1).run(None, inputs)))
        np.savez(out / "data" / f"{name}.npz", **inputs)
        np.savez(out / "data" / f"{name}.reference.npz", **reference)
        (out / "data" / f"{name}.onnx").write_bytes(proto.SerializeToString())
        for target in targets:
            artifact = f"artifacts/{name}-{target}.so"
            gimlet_tvm.build(proto, target_of(target, arch, cpu)).export(out / artifact)
            entries.append({"model": name, "target": target, "batch": BATCH.get(name, 1),
                            "artifact": artifact, "onnx": f"data/{name}.onnx",
                            "inputs": f"data/{name}.npz",
                            "reference": f"data/{name}.reference.npz",
                            "tolerance": TOLERANCE.get(target, 1e-3)})
            if size_of(out) > MAX_BYTES:
                raise GimletError(f"{out} is over {MAX_BYTES / 2**20:.0f} MiB after {artifact}: "
                                  "check fewer or smaller models")
    (out / "manifest.json").write_text(json.dumps({"artifacts": entries}, indent=1))
    shutil.copy2(CHECK_SCRIPT, out / "check.py")
    return entries


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="write the bundle, artifacts and check.py to OUT_DIR")
    prep.add_argument("out_dir", type=Path, help="a new folder (carry it to the device)")
    prep.add_argument("--targets", nargs="+", default=["cuda", "llvm"],
                      choices=["cuda", "vulkan", "llvm"])
    prep.add_argument("--models", nargs="+", default=MODELS, choices=sorted(SUITE))
    prep.add_argument("--arch", default="sm_90", help="CUDA arch of the device (H100/H200: sm_90)")
    prep.add_argument("--cpu", default="x86-64-v3",
                      help="LLVM CPU of the device's host for the CPU part (default: any AVX2 CPU)")
    prep.add_argument("--python-version", nargs="*", default=["3.12"], metavar="X.Y",
                      help="the device's CPython versions besides this one's (default: 3.12, the "
                           "H200 machines' Python)")
    args = parser.parse_args(argv)
    if args.out_dir.exists():
        parser.error(f"{args.out_dir} exists: give a new folder")
    try:
        entries = prepare(args.out_dir, args.targets, args.models, args.arch, args.cpu,
                          tuple(args.python_version))
    except GimletError as err:
        print(f"gpu_bundle: error: {err}", file=sys.stderr)
        return 2
    print(f"{len(entries)} artifacts, {size_of(args.out_dir) / 2**20:.1f} MiB in {args.out_dir}; "
          f"on the device: python3 {args.out_dir}/check.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
