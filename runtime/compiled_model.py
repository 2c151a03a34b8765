"""`CompiledModel`: a compiled executable with its interface, run on the target's device."""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import tvm
import tvm_ffi
from tvm.runtime.vm import VirtualMachine

from .. import __version__
from ..carriers import CARRIERS, carrier, from_carrier
from ..errors import ArtifactError, GimletError, RunError, TargetUnavailableError, summary
from ..io_spec import IOSpec, TensorSpec
from ..resources import Need, require
from . import artifact
from .index_checks import input_error
from .libraries import target_runtimes
from .placement_report import PlacementReport
from .remote import RemoteDevice, RemoteModel
from .tensors import device_tensors, numpy_converter, random_inputs
from .timing import BenchmarkResult

WEIGHTS_FUNCTION = "gimlet_weights"
"""The executable function returning the model's weights when placement moved them out of
`main` (`relax_passes.place_on_devices` writes it; they are passed to `main` after the inputs)."""


@dataclasses.dataclass(frozen=True)
class Profile:
    """One profiled run. `calls`: per VM call (kernel, library function, copy) and device:
    (name, device, count, total milliseconds), in first-call order; `planned_memory`: per
    target, the bytes the build's static memory plan allocates on that device (None where
    sizes depend on symbolic dims)."""

    calls: list[tuple[str, str, int, float]]
    planned_memory: dict[str, int | None]

    def per_device_ms(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        for _, device, _, ms in self.calls:
            totals[device] = totals.get(device, 0.0) + ms
        return totals

    def __str__(self) -> str:
        width = max([len(c[0]) for c in self.calls] + [4])
        lines = [f"{'call':<{width}}  {'device':<8} {'count':>5} {'total ms':>10}"]
        lines += [f"{n:<{width}}  {d:<8} {c:>5} {ms:>10.3f}" for n, d, c, ms in self.calls]
        per_device = ", ".join(f"{d}: {ms:.3f} ms" for d, ms in self.per_device_ms().items())
        memory = ", ".join(f"{name}: {'dynamic' if b is None else f'{b} bytes'}"
                           for name, b in self.planned_memory.items())
        lines.append(f"time per device: {per_device}; planned memory per device: {memory}")
        return "\n".join(lines)


def _with_dtype(convert: Callable[[Any], np.ndarray], dtype: str) -> Callable[[Any], np.ndarray]:
    """`convert`, then the carrier array viewed as `dtype` where it has a carrier."""
    if dtype not in CARRIERS:
        return convert
    return lambda value: from_carrier(convert(value), dtype)


class CompiledModel:
    """A model compiled for one target or placed across several, callable with numpy arrays.

    `model(*arrays)` returns the outputs as a list of numpy arrays in the model's output
    order; `model.run({name: array})` returns `{name: array}`. Inputs are checked against the
    model's interface first: a wrong name, shape or dtype raises `InputError` naming it; so
    does an index outside its axis, found by the kernel that reads it (the op, the input and
    the value named; the model stays usable).
    """

    def __init__(
        self,
        module: tvm.runtime.Module,
        io: IOSpec,
        targets: Sequence[Mapping[str, Any]],
        artifact_path: str | None = None,
        placement: Mapping[str, Any] | None = None,
        linker: Callable[..., Any] | None = None,
    ):
        self._module = module
        self._artifact_path = artifact_path  # set when loaded from an artifact file
        self._linker = linker  # links the artifact's library (TVM's fcompile); None: the host's
        self.io = io
        self.targets = [dict(t) for t in targets]
        self._placement = dict(placement) if placement is not None else None
        # What each target needs at run time, as the artifact records it (no compiler needed).
        self._runtimes = target_runtimes(self.targets)
        # Inputs the first device's kernels read without alignment, outputs the call allocated
        # (none in older artifacts).
        first = self.targets[0] if self.targets else {}
        self._unaligned = tuple(first.get("unaligned_inputs", ()))
        self._fresh = tuple(first.get("fresh_outputs", ()))
        # The VM's devices, in the build's vdevice order; inputs and constants live on the
        # first. They need not exist on this machine until the model runs.
        self.devices: list[tvm.runtime.Device] = [target.device() for target in self._runtimes]
        self.device = self.devices[0]
        self._vm: VirtualMachine | None = None
        self._main: tvm_ffi.Function | None = None
        self._weights: list[Any] = []
        # From the first call's result (see _outputs): whether the call returns a tuple, and
        # each output's conversion to numpy.
        self._output_plan: tuple[bool, tuple[Callable[[Any], np.ndarray], ...]] | None = None

    def _machine(self) -> VirtualMachine:
        """A VM over the model's devices (and its weights copied to them once): created on
        first run, so a model built for a device this machine lacks can still be exported."""
        for target, device in zip(self._runtimes, self.devices):
            reason = target.cannot_run()
            if reason is not None or not device.exist:
                raise TargetUnavailableError(
                    f"target '{target.name}' cannot run on this machine: "
                    f"{reason or 'no device'} (export it and run it where one exists)"
                )
        for target in self._runtimes:  # executables may call our runtime library functions
            target.load_libraries()
        # As an Executable, the VM links what is not linked yet (external kernels' objects).
        vm = VirtualMachine(tvm.runtime.Executable(self._module), self.devices)
        if not self._weights and vm.module.implements_function(WEIGHTS_FUNCTION):
            self._weights = list(vm[WEIGHTS_FUNCTION]())
        return vm

    def _entry(self) -> tvm_ffi.Function:
        if self._main is None:
            self._vm = self._machine()
            self._main = self._vm["main"]
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
        tensors = device_tensors(arrays, self.device, self._unaligned)
        try:
            return self._outputs(entry(*tensors, *self._weights))
        except GimletError:
            raise
        except Exception as err:  # TVM's runtime raises its checks' failures as many types
            # A kernel's check of run-time values (relax_passes.checked_indexing), raised
            # directly or wrapped by a parallel loop's task, names the op and the value;
            # anything else is TVM failing on inputs that fit the interface (a size past memory).
            error = input_error(err, dict(zip(self.input_names, arrays)))
            if error is not None:
                raise error from None
            raise RunError(f"running the model failed: {summary(err)}") from err

    def _outputs(self, result: Any) -> list[np.ndarray]:
        """The call's result as numpy arrays, converted as the first call's result was."""
        if self._output_plan is None:
            is_tuple = isinstance(result, (tvm_ffi.Array, list, tuple))
            flat = list(result) if is_tuple else [result]
            fresh = self._fresh if len(self._fresh) == len(flat) else (False,) * len(flat)
            self._output_plan = (is_tuple, tuple(
                _with_dtype(numpy_converter(value, owned), spec.dtype)
                for value, spec, owned in zip(flat, self.outputs, fresh)))
        is_tuple, converters = self._output_plan
        return [convert(value) for convert, value in zip(converters, result if is_tuple else (result,))]

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
        arrays = self._arrays(inputs, seed)
        for _ in range(warmup):
            self._execute(arrays)
        samples = []
        for _ in range(repeat):
            start = time.perf_counter()
            self._execute(arrays)
            samples.append(time.perf_counter() - start)
        return BenchmarkResult.from_samples(samples)

    def _arrays(self, inputs: Mapping[str, Any] | Sequence[Any] | None, seed: int = 0) -> list:
        """Checked inputs in interface order; random ones (symbolic dims 1) when None."""
        if inputs is None:
            return self.io.order_inputs(random_inputs(self.io, seed=seed))
        if isinstance(inputs, Mapping):
            return self.io.order_inputs((), inputs)
        return self.io.order_inputs(inputs)

    def remote(self, device: RemoteDevice) -> RemoteModel:
        """This model uploaded to a remote device (TVM RPC), callable like this one."""
        return RemoteModel(self, device, device.connect())

    def placement(self) -> PlacementReport:
        """Where each op runs, its modelled cost per device, and the cross-device copies."""
        if self._placement is None:
            raise GimletError(f"built for one target ({self.targets[0]['name']}): every op runs "
                              "there; placement needs several targets")
        return PlacementReport(self._placement)

    def profile(self, inputs: Mapping[str, Any] | Sequence[Any] | None = None) -> "Profile":
        """One run with every VM call timed (kernels, library calls, copies), each on its
        device (the device is synchronised around every call, so times are exact but the
        total exceeds an unprofiled run's)."""
        arrays = self._arrays(inputs)
        vm = self._machine()
        names = {(d.dlpack_device_type(), d.index): t.name for t, d in zip(self._runtimes, self.devices)}
        rows: dict[tuple[str, str], list[float]] = {}
        started: list[tuple[float, Any]] = []

        def instrument(func, symbol, before, result, *args):
            device = next((a.device for a in args if isinstance(a, tvm.runtime.Tensor)), None)
            if device is not None:
                device.sync()
            if before:
                started.append((time.perf_counter(), device))
            else:
                start, _ = started.pop()
                place = names.get((device.dlpack_device_type(), device.index), str(device)) if device else "host"
                rows.setdefault((str(symbol), place), []).append(time.perf_counter() - start)
            return 0

        vm.set_instrument(instrument)
        vm["main"](*device_tensors(arrays, self.device), *self._weights)
        return Profile(
            [(symbol, place, len(t), sum(t) * 1e3) for (symbol, place), t in rows.items()],
            {t["name"]: t.get("planned_memory") for t in self.targets},
        )

    @property
    def metadata(self) -> dict[str, Any]:
        """What the artifact records besides the code: interface, targets and versions."""
        return {
            "gimlet_tvm_version": __version__,
            "tvm_version": tvm.__version__,
            "targets": self.targets,
            "io": self.io.to_json(),
            "placement": self._placement,
        }

    def export(self, path: str | os.PathLike) -> None:
        """Write one artifact file (shared library + metadata), atomically; see `load`.

        A model loaded from an artifact writes a copy of that file (a loaded library cannot
        be exported again)."""
        if self._artifact_path is not None:
            artifact.copy(self._artifact_path, path)
        else:
            artifact.write(path, self._export_library, self.metadata)

    def _export_library(self, path: str) -> None:
        """The shared library, linked by the build's linker; a failed link names the linker's
        first error."""
        try:
            self._module.export_library(path, fcompile=self._linker)
        except RuntimeError as err:
            first = next((line for line in str(err).splitlines() if "error" in line.lower()), summary(err))
            raise ArtifactError(f"linking the artifact's library failed: {first.strip()}") from None


def _memory_need(path: str | os.PathLike, meta: dict[str, Any]) -> Need:
    """What running an artifact here needs at least: its file (code and weights, which the
    loader maps and the VM copies out), the memory its plan allocates on this machine's CPU,
    and its inputs and outputs where their shapes are static."""
    need = Need({"the artifact (code and weights)": os.path.getsize(path)})
    host = tvm.cpu().dlpack_device_type()
    # Artifacts written before targets recorded their device type count no planned memory.
    need.parts["planned memory"] = sum(
        int(t.get("planned_memory") or 0) for t in meta["targets"]
        if "device_type" in t and tvm.device(t["device_type"]).dlpack_device_type() == host)
    io = IOSpec.from_json(meta["io"])
    static = [t for t in (*io.inputs, *io.outputs) if all(isinstance(d, int) for d in t.shape)]
    for spec in static:
        need.note(f"{spec.name} {spec.dtype}{list(spec.shape)}", _nbytes(spec))
    need.add_peak(sum(_nbytes(spec) for spec in static), "the inputs and outputs")
    return need


def _nbytes(spec: TensorSpec) -> int:
    return math.prod(spec.shape) * np.dtype(carrier(spec.dtype)).itemsize


def load(path: str | os.PathLike) -> CompiledModel:
    """Load an artifact written by `CompiledModel.export`."""
    meta = artifact.read_metadata(path)
    try:
        runtimes = target_runtimes(meta["targets"])
        io = IOSpec.from_json(meta["io"])
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise ArtifactError(f"corrupt artifact (metadata: {summary(err)}): {os.fspath(path)}") from None
    if not runtimes:
        raise ArtifactError(f"corrupt artifact (metadata names no target): {os.fspath(path)}")
    for target in runtimes:
        reason = target.cannot_run()
        if reason is not None:
            raise TargetUnavailableError(
                f"artifact is built for '{target.name}', which cannot run on this machine: {reason}"
            )
    if meta.get("tvm_version") != tvm.__version__:
        raise ArtifactError(
            f"artifact was built with TVM {meta.get('tvm_version')}, this is TVM "
            f"{tvm.__version__}: rebuild it: {os.fspath(path)}"
        )
    require(_memory_need(path, meta), f"loading {os.fspath(path)}")
    try:
        module = tvm.runtime.load_module(os.fspath(path))
    except Exception as err:
        raise ArtifactError(f"cannot load artifact {os.fspath(path)}: {err}") from None
    return CompiledModel(
        module, io, meta["targets"], artifact_path=os.fspath(path),
        placement=meta.get("placement"),
    )
