"""An architecture compiled for a target: the family's Relax module through our pipeline.

The module exported from the family (`prefill`, `decode`, `create_paged_kv_cache`, weights as
one packed parameter tuple) goes through the same Relax pipeline as an ONNX model: graph
fusion, library dispatch, the target's default schedules, tuning records and the kernel
selection stored with them when given (`select_llm_kernels`: the decode GEMVs' kernels chosen by
verified measurement, a kernel generator's among them). The result depends on the architecture
(`LLMConfig`), the weights' format, the target and the records, never on the weights
themselves: one artifact serves every checkpoint of that architecture, and `compiled_for`
keeps one per key in a cache folder so a model compiles once per machine.

The artifact is our usual one file (`runtime.artifact`: shared library + JSON metadata) with
the config and the parameters' names, shapes and dtypes in its metadata.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import tvm

import gimlet_tvm

from .. import __version__
from ..compiler import device_pipeline, resolve_target
from ..errors import ArtifactError, CompileError, GimletError, TargetUnavailableError, summary
from ..logs import quiet_tvm_logs
from ..runtime import artifact
from ..runtime.libraries import TargetRuntime
from ..schedules.kernel_selection.choices import KernelSelection
from ..schedules.tuning.records import ApplyRecords, RecordsDB
from ..targets import TargetLike
from .config import LLMConfig
from .families import FAMILIES
from .quantization import QUANTIZATIONS, quantize_module

logger = logging.getLogger(__name__)
ARTIFACT_KIND = "llm"


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclasses.dataclass
class CompiledLLM:
    """The executable of one architecture for one target, and what its weights must be."""

    module: tvm.runtime.Module
    config: LLMConfig
    quantization: str | None
    params: list[ParamSpec]
    target: dict[str, Any]
    file: str | None = None   # the artifact the module was loaded from or last written to

    @property
    def runtime(self) -> TargetRuntime:
        return TargetRuntime.from_metadata(self.target)

    def metadata(self) -> dict[str, Any]:
        return {"kind": ARTIFACT_KIND, "gimlet_tvm_version": __version__, "tvm_version": tvm.__version__,
                "config": self.config.to_json(), "quantization": self.quantization,
                "params": [dataclasses.asdict(p) for p in self.params], "targets": [self.target]}

    def export(self, path: str | os.PathLike) -> None:
        """One file, written atomically: the library and its metadata. (A module loaded from
        a file cannot be exported again by TVM: that file is copied.)"""
        if self.file is not None:
            artifact.copy(self.file, path)
        else:
            artifact.write(path, self.module.export_library, self.metadata())


def llm_module(config: LLMConfig, target: tvm.target.Target,
               quantization: str | None = None) -> tuple[tvm.IRModule, list[tuple[str, Any]]]:
    """`config`'s architecture as the family exports it for `target` (`prefill`, `decode`,
    the KV cache's functions), and its named parameters: what `compile_llm` builds and
    `select_llm_kernels` selects kernels for."""
    if quantization not in QUANTIZATIONS:
        raise GimletError(f"quantization must be one of {', '.join(map(str, QUANTIZATIONS))}, "
                          f"not {quantization!r}")
    with quiet_tvm_logs(), target:
        model = FAMILIES[config.family].model(config)
        quantize_module(model, quantization)
        return model.export_tvm(spec=model.export_spec())


def compile_llm(config: LLMConfig, target: TargetLike, quantization: str | None = None,
                records: str | os.PathLike | None = None) -> CompiledLLM:
    """Build `config`'s architecture for `target`; `quantization` ("q8", "q4") keeps linear
    weights quantized; `records`: a records directory whose tuning records schedule the
    target's kernels and whose kernel selection for the target (if any) is applied."""
    spec, tvm_target = resolve_target(target)
    reason = spec.can_compile()
    if reason is not None:
        raise TargetUnavailableError(f"cannot compile for {spec.name} on this machine: {reason}")
    tuned = ApplyRecords(RecordsDB(records), tvm_target) if records is not None else None
    selection = KernelSelection.load(records, tvm_target) if records is not None else None
    with quiet_tvm_logs(), tvm_target:
        try:
            # Exporting builds the KV cache's kernels for the target, which may refuse the shape.
            mod, named = llm_module(config, tvm_target, quantization)
            chosen = selection.pass_for(tvm_target) if selection is not None else None
            # No index checks in the kernels: the engine checks token ids before a run, and
            # the KV cache's page indices are its own.
            with spec.codegen_hooks(tvm_target) as codegen:
                pipeline = device_pipeline([(spec, tvm_target)], tuned, selection=chosen, checked_indices=False)
                executable = tvm.compile(mod, tvm_target, relax_pipeline=pipeline)
        except GimletError:
            raise
        except Exception as err:
            raise CompileError(f"compiling {config.family} for {spec.name} failed: {summary(err)}") from err
        device_code = spec.check_code(executable.mod, codegen, tvm_target)
    params = [ParamSpec(name, tuple(int(d) for d in p.shape), p.dtype) for name, p in named]
    built_for = {"name": spec.name, "device_type": spec.device_type,
                 "runtime_libraries": list(spec.runtime_libraries), "arch": spec.arch,
                 "target": json.loads(json.dumps(dict(tvm_target.export()), default=list)),
                 "device_code": device_code.to_json()}
    return CompiledLLM(executable.mod, config, quantization, params, built_for)


def load_compiled(path: str | os.PathLike) -> CompiledLLM:
    """An artifact written by `CompiledLLM.export`, checked to be an LLM this TVM can load."""
    meta = artifact.read_metadata(path)
    if meta.get("kind") != ARTIFACT_KIND:
        raise ArtifactError(f"{os.fspath(path)} is a compiled model, not a compiled LLM")
    if meta.get("tvm_version") != tvm.__version__:
        raise ArtifactError(f"{os.fspath(path)} was built with TVM {meta.get('tvm_version')}, "
                            f"this is TVM {tvm.__version__}: rebuild it")
    try:
        module = tvm.runtime.load_module(os.fspath(path))
    except Exception as err:
        raise ArtifactError(f"cannot load {os.fspath(path)}: {summary(err)}") from err
    return CompiledLLM(module, LLMConfig.from_json(meta["config"]), meta["quantization"],
                       [ParamSpec(p["name"], tuple(p["shape"]), p["dtype"]) for p in meta["params"]],
                       meta["targets"][0], os.fspath(path))


def cache_dir() -> Path:
    """Where compiled architectures are kept: $GIMLET_TVM_CACHE or ~/.cache/gimlet-tvm."""
    root = os.environ.get("GIMLET_TVM_CACHE") or Path.home() / ".cache" / "gimlet-tvm"
    return Path(root) / "llm"


@functools.lru_cache(maxsize=1)
def _compiler_fingerprint() -> str:
    """A hash of the sources that decide the compiled code (TVM's version, the compiler's
    modules, targets, passes, schedules, and this room's model definitions): a cached artifact
    from other code is never reused, while the engine, sampling or tokenizer may change freely."""
    digest = hashlib.sha256(tvm.__version__.encode())
    here = Path(__file__).parent
    sources = [*Path(gimlet_tvm.__file__).parent.glob("*.py"), Path(__file__), here / "config.py",
               here / "quantization.py", *(here / "families").rglob("*.py")]
    for package in (gimlet_tvm.targets, gimlet_tvm.relax_passes, gimlet_tvm.schedules):
        sources += Path(package.__file__).parent.rglob("*.py")
    for source in sorted(sources):
        digest.update(source.read_bytes())
    return digest.hexdigest()


def _records_fingerprint(records: str | os.PathLike | None) -> str | None:
    """A hash of the records directory's files (tuning records, kernel selection; the generated
    kernels a selection names carry their digests in it), or None without one."""
    if records is None:
        return None
    digest = hashlib.sha256()
    for path in sorted(Path(records).iterdir()):
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def compiled_for(config: LLMConfig, target: TargetLike, quantization: str | None = None,
                 records: str | os.PathLike | None = None) -> CompiledLLM:
    """The compiled architecture from the cache, compiled and stored on first use (with
    `records`, as `compile_llm` applies them: keyed by their content too)."""
    spec, tvm_target = resolve_target(target)
    key = json.dumps([config.to_json(), quantization, str(tvm_target), _compiler_fingerprint(),
                      *([_records_fingerprint(records)] if records is not None else [])],
                     sort_keys=True, default=str)
    path = cache_dir() / f"{config.family}-{spec.name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
    if path.exists():
        try:
            return load_compiled(path)
        except ArtifactError as err:
            logger.warning(f"recompiling: the cached {path.name} is unusable ({err})")
    compiled = compile_llm(config, target, quantization, records)
    path.parent.mkdir(parents=True, exist_ok=True)
    compiled.export(path)
    compiled.file = str(path)
    return compiled

