"""`CompiledModel`: a compiled executable with its interface, run on the target's device."""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

from .. import __version__
from ..errors import ArtifactError, TargetUnavailableError
from ..io_spec import IOSpec, TensorSpec
from ..targets import lookup
from . import artifact
from .extensions import load_extensions

if TYPE_CHECKING:
    from .remote import RemoteDevice, RemoteModel


@dataclasses.dataclass(frozen=True)
class BenchmarkResult:
    """Latency of repeated runs, in milliseconds."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    min_ms: float
    max_ms: float
    runs: int

    @classmethod
    def from_samples(cls, seconds: Sequence[float]) -> "BenchmarkResult":
        ms = sorted(s * 1e3 for s in seconds)
        deciles = statistics.quantiles(ms, n=10, method="inclusive") if len(ms) > 1 else [ms[0]] * 9
        return cls(statistics.median(ms), deciles[0], deciles[-1], ms[0], ms[-1], len(ms))

    def __str__(self) -> str:
        return (
            f"median {self.median_ms:.3f} ms (p10 {self.p10_ms:.3f}, p90 {self.p90_ms:.3f}, "
            f"{self.runs} runs)"
        )


class CompiledModel:
    """A model compiled for one target, callable with numpy arrays.

    `model(*arrays)` returns the outputs as a list of numpy arrays in the model's output
    order; `model.run({name: array})` returns `{name: array}`. Inputs are checked against the
    model's interface first: a wrong name, shape or dtype raises `InputError` naming it.
    """

    def __init__(
        self,
        module: tvm.runtime.Module,
        io: IOSpec,
        targets: Sequence[Mapping[str, Any]],
        artifact_path: str | None = None,
    ):
        self._module = module
        self._artifact_path = artifact_path  # set when loaded from an artifact file
        self.io = io
        self.targets = [dict(t) for t in targets]
        self._spec, _ = lookup(self.targets[0]["name"])
        self.device: tvm.runtime.Device = self._spec.device()  # need not exist on this machine
        self._main: tvm_ffi.Function | None = None

    def _entry(self) -> tvm_ffi.Function:
        """The VM's `main`, created on first run: a model built for a device this machine
        lacks can still be exported."""
        if self._main is None:
            reason = self._spec.can_run()
            if reason is not None or not self.device.exist:
                raise TargetUnavailableError(
                    f"target '{self._spec.name}' cannot run on this machine: "
                    f"{reason or 'no device'} (export it and run it where one exists)"
                )
            load_extensions()  # executables may call our runtime library functions
            self._main = relax.VirtualMachine(self._module, self.device)["main"]
        return self._main

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        return self.io.inputs

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        return self.io.outputs

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.io.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.io.outputs]

    def __call__(self, *arrays: Any) -> list[np.ndarray]:
        return self._execute(self.io.order_inputs(arrays))

    def run(self, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        outputs = self._execute(self.io.order_inputs((), inputs))
        return dict(zip(self.output_names, outputs))

    def _execute(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        entry = self._entry()
        tensors = [tvm.runtime.tensor(np.require(a, requirements="C"), self.device) for a in arrays]
        result = entry(*tensors)
        flat = list(result) if isinstance(result, (tvm_ffi.Array, list, tuple)) else [result]
        return [to_numpy(value) for value in flat]

    def benchmark(
        self,
        inputs: Mapping[str, Any] | Sequence[Any] | None = None,
        *,
        repeat: int = 50,
        warmup: int = 5,
        seed: int = 0,
    ) -> BenchmarkResult:
        """Time whole calls (numpy in, numpy out), after `warmup` untimed ones.

        Without `inputs`, random inputs are drawn for the interface, symbolic dims set to 1.
        """
        if inputs is None:
            arrays = self.io.order_inputs(random_inputs(self.io, seed=seed))
        elif isinstance(inputs, Mapping):
            arrays = self.io.order_inputs((), inputs)
        else:
            arrays = self.io.order_inputs(inputs)
        for _ in range(warmup):
            self._execute(arrays)
        samples = []
        for _ in range(repeat):
            start = time.perf_counter()
            self._execute(arrays)
            samples.append(time.perf_counter() - start)
        return BenchmarkResult.from_samples(samples)

    def remote(self, device: "RemoteDevice") -> "RemoteModel":
        """This model uploaded to a remote device (TVM RPC), callable like this one."""
        from .remote import RemoteModel

        return RemoteModel(self, device, device.connect())

    @property
    def metadata(self) -> dict[str, Any]:
        """What the artifact records besides the code: interface, targets and versions."""
        return {
            "gimlet_tvm_version": __version__,
            "tvm_version": tvm.__version__,
            "targets": self.targets,
            "io": self.io.to_json(),
        }

    def export(self, path: str | os.PathLike) -> None:
        """Write one artifact file (shared library + metadata), atomically; see `load`.

        A model loaded from an artifact writes a copy of that file (a loaded library cannot
        be exported again)."""
        if self._artifact_path is not None:
            artifact.copy(self._artifact_path, path)
        else:
            artifact.write(path, self._module.export_library, self.metadata)


def to_numpy(value: Any) -> np.ndarray:
    """An output as numpy: tensors copy to the host; shapes (ONNX `Shape`) become int64."""
    if isinstance(value, tvm_ffi.Shape):
        return np.array(list(value), dtype=np.int64)
    return value.numpy()


def random_inputs(io: IOSpec, *, seed: int = 0, dims: Mapping[str, int] | None = None) -> list:
    """Random arrays for `io`'s inputs; symbolic dims take `dims[name]`, else 1."""
    rng = np.random.default_rng(seed)
    arrays = []
    for spec in io.inputs:
        shape = [d if isinstance(d, int) else (dims or {}).get(d, 1) for d in spec.shape]
        dtype = np.dtype(spec.dtype)
        if dtype.kind == "f":
            arrays.append(rng.standard_normal(shape).astype(dtype))
        elif dtype.kind == "b":
            arrays.append(rng.integers(0, 2, shape).astype(dtype))
        else:
            arrays.append(rng.integers(0, 8, shape).astype(dtype))
    return arrays


def load(path: str | os.PathLike) -> CompiledModel:
    """Load an artifact written by `CompiledModel.export`."""
    meta = artifact.read_metadata(path)
    spec, _ = lookup(meta["targets"][0]["name"])
    reason = spec.can_run()
    if reason is not None:
        raise TargetUnavailableError(
            f"artifact is built for '{spec.name}', which cannot run on this machine: {reason}"
        )
    if meta.get("tvm_version") != tvm.__version__:
        raise ArtifactError(
            f"artifact was built with TVM {meta.get('tvm_version')}, this is TVM "
            f"{tvm.__version__}: rebuild it: {os.fspath(path)}"
        )
    try:
        module = tvm.runtime.load_module(os.fspath(path))
    except Exception as err:
        raise ArtifactError(f"cannot load artifact {os.fspath(path)}: {err}") from None
    return CompiledModel(
        module, IOSpec.from_json(meta["io"]), meta["targets"], artifact_path=os.fspath(path)
    )
