"""Checkpoints: an HF folder (`config.json`, `*.safetensors`) or a GGUF file, read as one
`Checkpoint` that hands out tensors by their Hugging Face names.

GGUF tensors are renamed to HF names here (llama.cpp's names are one scheme for every
architecture), and llama.cpp's permutation of Llama's Q/K rows (its RoPE pairs adjacent
elements, HF's rotates halves) is undone. Quantized GGUF tensors (Q8_0, Q4_0, Q4_1, ...) are
dequantized by the `gguf` package when asked for as floats, or handed out as their raw blocks
(`raw`) for kernels that keep them quantized.

Bad files raise `WeightsError` naming the file and the tensor: a file cut short, a tensor the
architecture needs but the file lacks, a tensor of the wrong shape or of an unsupported type.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import struct
from pathlib import Path
from typing import Any, Callable

import gguf
import ml_dtypes
import numpy as np

from ..errors import WeightsError
from .config import LLMConfig

SAFETENSORS_DTYPES = {
    "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64,
    "I64": np.int64, "I32": np.int32, "I8": np.int8, "U8": np.uint8,
}


class Checkpoint:
    """A model's config and its tensors by HF name; `get` returns float32 arrays."""

    def __init__(self, path: Path, config: LLMConfig, names: list[str], read: Callable[[str], np.ndarray],
                 raw: Callable[[str], tuple[str, np.ndarray]] | None = None,
                 metadata: dict[str, Any] | None = None, gguf_reader: Any = None):
        self.path, self.config, self.names = path, config, names
        self._read, self._raw = read, raw
        self.metadata = metadata or {}
        self.gguf_reader = gguf_reader   # a GGUF's open reader (its tokenizer is read from it)

    def get(self, name: str) -> np.ndarray:
        if name not in self.names:
            raise WeightsError(f"{self.path.name}: the tensor '{name}' is missing "
                               f"({self.config.family} with {self.config.num_layers} layers needs it)")
        try:
            return np.ascontiguousarray(self._read(name), dtype=np.float32)
        except WeightsError:
            raise
        except (ValueError, TypeError, IndexError, NotImplementedError) as err:
            raise WeightsError(f"{self.path.name}: cannot read the tensor '{name}': {err}") from err

    def first_layers(self, layers: int) -> "Checkpoint":
        """The same file as a model of its first `layers` layers (the rest are not read): a
        cheap draft of the model for speculative decoding."""
        if not 1 <= layers <= self.config.num_layers:
            raise WeightsError(f"{self.path.name} has {self.config.num_layers} layers; cannot keep {layers}")
        view = copy.copy(self)
        view.config = dataclasses.replace(self.config, num_layers=layers)
        return view

    def raw(self, name: str) -> tuple[str, np.ndarray]:
        """(GGUF type name, the tensor's bytes as stored) for quantized kernels; float files
        hand out ("F32", the array)."""
        if self._raw is None:
            return "F32", self.get(name)
        if name not in self.names:
            self.get(name)  # raises the missing-tensor error
        return self._raw(name)


def open_checkpoint(path: str | Path) -> Checkpoint:
    """An HF folder or a `.gguf` file."""
    path = Path(path)
    if path.is_dir():
        return _open_hf_dir(path)
    if path.suffix == ".gguf" and path.is_file():
        return _open_gguf(path)
    if not path.exists():
        raise WeightsError(f"no model at {path}")
    raise WeightsError(f"{path} is neither a folder with config.json and *.safetensors nor a .gguf file")


# --- Hugging Face folders ------------------------------------------------------------------

def _open_hf_dir(folder: Path) -> Checkpoint:
    config = LLMConfig.from_hf_dir(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        found = ", ".join(sorted(p.name for p in folder.glob("*.bin"))) or "nothing"
        raise WeightsError(f"{folder} has no *.safetensors weights (found {found}; only "
                           "safetensors is read)")
    tensors: dict[str, tuple[Path, dict[str, Any], int]] = {}
    for file in files:
        header, start = _safetensors_header(file)
        for name, info in header.items():
            if name != "__metadata__":
                tensors[name] = (file, info, start)

    def read(name: str) -> np.ndarray:
        file, info, start = tensors[name]
        dtype = SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise WeightsError(f"{file.name}: tensor '{name}' has type {info['dtype']} (supported: "
                               f"{', '.join(SAFETENSORS_DTYPES)})")
        begin, end = info["data_offsets"]
        count = int(np.prod(info["shape"], dtype=np.int64))
        if end - begin != count * np.dtype(dtype).itemsize or start + end > file.stat().st_size:
            raise WeightsError(f"{file.name}: tensor '{name}' runs past the end of the file "
                               "(truncated?) or its size does not match its shape")
        data = np.memmap(file, dtype=dtype, mode="r", offset=start + begin, shape=(count,))
        return data.reshape(info["shape"]).astype(np.float32)

    return Checkpoint(folder, config, list(tensors), read)


def _safetensors_header(file: Path) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and where its data starts."""
    try:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > file.stat().st_size:
                raise ValueError("header length past the end of the file")
            return json.loads(f.read(length)), 8 + length
    except (OSError, ValueError, struct.error) as err:
        raise WeightsError(f"{file.name} is not a readable safetensors file: {err}") from err


# --- GGUF ----------------------------------------------------------------------------------

# llama.cpp tensor names (per block `blk.N.`) -> HF names (per layer), by family.
_LLAMA_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GPT2_NAMES = {
    "token_embd.weight": "transformer.wte.weight",
    "position_embd.weight": "transformer.wpe.weight",
    "output_norm.weight": "transformer.ln_f.weight", "output_norm.bias": "transformer.ln_f.bias",
    "output.weight": "lm_head.weight",
    "attn_norm.weight": "ln_1.weight", "attn_norm.bias": "ln_1.bias",
    "attn_qkv.weight": "attn.c_attn.weight", "attn_qkv.bias": "attn.c_attn.bias",
    "attn_output.weight": "attn.c_proj.weight", "attn_output.bias": "attn.c_proj.bias",
    "ffn_norm.weight": "ln_2.weight", "ffn_norm.bias": "ln_2.bias",
    "ffn_up.weight": "mlp.c_fc.weight", "ffn_up.bias": "mlp.c_fc.bias",
    "ffn_down.weight": "mlp.c_proj.weight", "ffn_down.bias": "mlp.c_proj.bias",
}
# GPT-2's projections, which llama.cpp stores [out, in] and HF (`Conv1D`) [in, out].
_GPT2_TRANSPOSED = ("attn_qkv.weight", "attn_output.weight", "ffn_up.weight", "ffn_down.weight")
_GGUF_NAMES = {"llama": (_LLAMA_NAMES, "model.layers"), "qwen2": (_LLAMA_NAMES, "model.layers"),
               "gpt2": (_GPT2_NAMES, "transformer.h")}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def _hf_name(gguf_name: str, family: str) -> str | None:
    names, layers = _GGUF_NAMES[family]
    match = _BLOCK.fullmatch(gguf_name)
    if match is None:
        return names.get(gguf_name)
    inner = names.get(match.group(2))
    return f"{layers}.{match.group(1)}.{inner}" if inner else None


def _open_gguf(path: Path) -> Checkpoint:
    try:
        reader = gguf.GGUFReader(path)
    except Exception as err:  # the reader raises ValueError, KeyError, struct errors on bad files
        raise WeightsError(f"{path.name} is not a readable GGUF file (truncated or corrupt?): "
                           f"{type(err).__name__}: {err}") from err
    fields = {}
    for key, field in reader.fields.items():
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
            continue
        try:
            fields[key] = field.contents()
        except Exception:  # noqa: BLE001  (a field of a type the reader cannot decode: unused)
            continue
    if "tokenizer.ggml.tokens" in reader.fields:   # the vocabulary's size, where no field says it
        fields["tokenizer.ggml.tokens"] = range(len(reader.fields["tokenizer.ggml.tokens"].data))
    tensors = {t.name: t for t in reader.tensors}
    config = LLMConfig.from_gguf(fields, set(tensors))
    by_hf = {}
    for gguf_name, tensor in tensors.items():
        hf = _hf_name(gguf_name, config.family)
        if hf is not None:
            by_hf[hf] = tensor

    def unpermute(name: str, array: np.ndarray) -> np.ndarray:
        """Undo llama.cpp's Q/K row permutation (Llama GGUFs only)."""
        heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}
        kind = name.split(".")[-2]
        if fields.get("general.architecture") != "llama" or kind not in heads:
            return array
        n = heads[kind]
        shape = array.shape
        return array.reshape(n, shape[0] // n // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)

    def read(name: str) -> np.ndarray:
        tensor = by_hf[name]
        try:
            array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as err:
            raise WeightsError(f"{path.name}: tensor '{tensor.name}' has the unsupported type "
                               f"{tensor.tensor_type.name}") from err
        array = unpermute(name, np.asarray(array, dtype=np.float32))
        return array.T if config.family == "gpt2" and tensor.name.endswith(_GPT2_TRANSPOSED) else array

    def raw(name: str) -> tuple[str, np.ndarray]:
        tensor = by_hf[name]
        return tensor.tensor_type.name, unpermute(name, np.asarray(tensor.data))

    return Checkpoint(path, config, list(by_hf), read, raw, metadata=fields, gguf_reader=reader)
