"""The wheel installs and works: built with `pip wheel`, installed into a fresh venv outside
the checkout, it compiles and runs a suite model from a folder outside the checkout.

The venv sees the project venv's packages (TVM, onnx, ...) through a .pth file instead of
downloading them again; its own site-packages comes first, so `gimlet_tvm` is the wheel's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import numpy as np
import pytest

from gimlet_tvm.models import SUITE

from .conftest import assert_matches, onnxruntime_outputs, suite_model

REPO = Path(__file__).resolve().parents[1]
ROOMS = {"gimlet_tvm": "gimlet_tvm", "targets": "gimlet_tvm/targets",
         "relax_passes": "gimlet_tvm/relax_passes", "schedules": "gimlet_tvm/schedules",
         "runtime": "gimlet_tvm/runtime"}


def source_files() -> list[str]:
    """The checkout's files as a fresh clone (plus untracked, not ignored) would have them."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [path for path in listed.splitlines() if (REPO / path).is_file()]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """`pip wheel --no-deps` on a copy of the sources (setuptools writes build/ beside them)."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    source = tmp_path / "source"
    for path in source_files():
        (source / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / path, source / path)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                    str(tmp_path / "wheels"), str(source)], check=True, timeout=300)
    (wheel,) = (tmp_path / "wheels").glob("gimlet_tvm-*.whl")
    return wheel


def installed_venv(tmp_path: Path, wheel: Path) -> Path:
    """A fresh venv with the wheel installed, layered on the project venv's packages."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # Plain folders: .pth files in them are not run, so the checkout's editable install of
    # gimlet_tvm stays out of sight.
    layers = [path for path in sys.path if path.endswith("site-packages")]
    (site / "project-venv.pth").write_text("\n".join(layers) + "\n")
    # pip comes from the layers; --ignore-installed: it must not touch the project's install.
    subprocess.run([python, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed",
                    "-q", str(wheel)], check=True, timeout=300)
    return env_dir


def test_wheel_carries_every_module_and_extension_source(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    wanted = {ROOMS[path.split("/")[0]] + path[len(path.split("/")[0]):]
              for path in source_files()
              if path.split("/")[0] in ROOMS and path.endswith((".py", ".cc", ".h", ".json"))}
    missing = sorted(wanted - names)
    assert not missing, f"the wheel lacks {len(missing)} files (a package without __init__.py?): {missing[:10]}"


def test_installed_wheel_compiles_and_runs_a_model_outside_the_checkout(tmp_path, wheel: Path) -> None:
    env_dir = installed_venv(tmp_path, wheel)
    work = tmp_path / "work"
    work.mkdir()
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["PATH"] = f"{env_dir / 'bin'}{os.pathsep}{env['PATH']}"

    def run(*command: str) -> str:
        result = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, f"{command} failed:\n{result.stdout}\n{result.stderr}"
        return result.stdout

    where = run("python", "-c", "import gimlet_tvm; print(gimlet_tvm.__file__)")
    assert Path(where.strip()).is_relative_to(env_dir), where
    (work / "mlp.onnx").write_bytes(suite_model("mlp").SerializeToString())
    inputs = SUITE["mlp"].example_inputs(batch=2)
    np.savez(work / "in.npz", **inputs)
    run("gimlet-tvm", "compile", "mlp.onnx", "-t", "llvm", "-o", "mlp.so")
    run("gimlet-tvm", "run", "mlp.so", "--inputs", "in.npz", "--outputs", "out.npz")
    with np.load(work / "out.npz") as out:
        ours = [out[name] for name in out.files]
    assert_matches(ours, onnxruntime_outputs(suite_model("mlp"), inputs))
