"""`LLMConfig`: one description of a decoder-only model, read from an HF `config.json` or from
GGUF metadata, so the families and the engine never look at either format.

A family is named by HF's `model_type` ("llama", "mistral", "qwen2", "gpt2"); GGUF's
`general.architecture` names map onto the same names. Anything a family cannot build
(sliding-window attention, an unknown RoPE scaling, an unknown activation) is refused here
with a `WeightsError` that says what is supported.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

from ..errors import WeightsError

# HF `model_type` -> family module name (gimlet_tvm.llm.families).
FAMILY_OF_MODEL_TYPE = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "gpt2": "gpt2"}
# GGUF `general.architecture` -> HF `model_type`.
MODEL_TYPE_OF_GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "gpt2": "gpt2"}
ROPE_SCALINGS = ("default", "linear", "llama3")
ACTIVATIONS = ("silu", "gelu_new", "gelu_pytorch_tanh", "gelu")


@dataclasses.dataclass(frozen=True)
class LLMConfig:
    """The architecture of one model: what the family builds and the engine sizes the cache by."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    context_length: int
    norm_eps: float
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise WeightsError(f"{self.num_heads} attention heads do not split into "
                               f"{self.num_kv_heads} key/value heads")
        if self.hidden_act not in ACTIVATIONS:
            raise WeightsError(f"activation '{self.hidden_act}' is not supported "
                               f"(supported: {', '.join(ACTIVATIONS)})")
        kind = (self.rope_scaling or {}).get("rope_type", "default")
        if kind not in ROPE_SCALINGS:
            raise WeightsError(f"RoPE scaling '{kind}' is not supported "
                               f"(supported: {', '.join(ROPE_SCALINGS)})")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "LLMConfig":
        return cls(**data)

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> "LLMConfig":
        """From a Hugging Face `config.json`'s contents."""
        model_type = config.get("model_type")
        family = FAMILY_OF_MODEL_TYPE.get(model_type)
        if family is None:
            raise WeightsError(f"model type '{model_type}' is not supported "
                               f"(supported: {', '.join(FAMILY_OF_MODEL_TYPE)})")
        if family == "gpt2":
            hidden = config["n_embd"]
            return cls(
                family=family, vocab_size=config["vocab_size"], hidden_size=hidden,
                intermediate_size=config.get("n_inner") or 4 * hidden,
                num_layers=config["n_layer"], num_heads=config["n_head"],
                num_kv_heads=config["n_head"], head_dim=hidden // config["n_head"],
                context_length=config["n_positions"], norm_eps=config["layer_norm_epsilon"],
                hidden_act=config.get("activation_function", "gelu_new"),
                tie_word_embeddings=config.get("tie_word_embeddings", True), attention_bias=True,
            )
        if config.get("use_sliding_window") or (
                family == "llama" and config.get("sliding_window") is not None
                and config["sliding_window"] < config["max_position_embeddings"]):
            raise WeightsError("sliding-window attention is not supported (the window must "
                               "cover the whole context)")
        heads = config["num_attention_heads"]
        # transformers 5 writes `rope_parameters` (theta and scaling together); older,
        # `rope_theta` and `rope_scaling`.
        rope = dict(config.get("rope_parameters") or {})
        return cls(
            family=family, vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"], num_layers=config["num_hidden_layers"],
            num_heads=heads, num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            context_length=config["max_position_embeddings"], norm_eps=config["rms_norm_eps"],
            hidden_act=config.get("hidden_act", "silu"),
            rope_theta=float(config.get("rope_theta") or rope.get("rope_theta", 10000.0)),
            rope_scaling=_rope_scaling(config.get("rope_scaling") or rope),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", family == "qwen2")),
        )

    @classmethod
    def from_hf_dir(cls, folder: str | Path) -> "LLMConfig":
        path = Path(folder) / "config.json"
        try:
            return cls.from_hf(json.loads(path.read_text()))
        except (OSError, ValueError) as err:
            raise WeightsError(f"cannot read {path}: {err}") from err
        except KeyError as err:
            raise WeightsError(f"{path} lacks the field {err}") from err

    @classmethod
    def from_gguf(cls, fields: Mapping[str, Any], tensor_names: set[str]) -> "LLMConfig":
        """From GGUF metadata (`{key: value}`); `tensor_names` tells tied from untied output."""
        arch = fields.get("general.architecture")
        model_type = MODEL_TYPE_OF_GGUF_ARCH.get(arch)
        if model_type is None:
            raise WeightsError(f"GGUF architecture '{arch}' is not supported "
                               f"(supported: {', '.join(MODEL_TYPE_OF_GGUF_ARCH)})")

        def get(key: str, default: Any = None) -> Any:
            value = fields.get(f"{arch}.{key}", default)
            if value is None:
                raise WeightsError(f"the GGUF metadata lacks {arch}.{key}")
            return value

        heads = int(get("attention.head_count"))
        hidden = int(get("embedding_length"))
        vocab = int(fields.get(f"{arch}.vocab_size") or len(fields.get("tokenizer.ggml.tokens", ())))
        common = dict(vocab_size=vocab, hidden_size=hidden, num_layers=int(get("block_count")),
                      num_heads=heads, context_length=int(get("context_length")),
                      intermediate_size=int(get("feed_forward_length")),
                      tie_word_embeddings="output.weight" not in tensor_names)
        if model_type == "gpt2":
            return cls(family="gpt2", num_kv_heads=heads, head_dim=hidden // heads,
                       norm_eps=float(get("attention.layer_norm_epsilon")), hidden_act="gelu_new",
                       attention_bias=True, **common)
        head_dim = int(fields.get(f"{arch}.attention.key_length") or hidden // heads)
        scaling = None
        if fields.get(f"{arch}.rope.scaling.type") == "linear":
            scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
        return cls(family=FAMILY_OF_MODEL_TYPE[model_type],
                   num_kv_heads=int(get("attention.head_count_kv", heads)), head_dim=head_dim,
                   norm_eps=float(get("attention.layer_norm_rms_epsilon")),
                   rope_theta=float(get("rope.freq_base", 10000.0)), rope_scaling=scaling,
                   attention_bias=model_type == "qwen2", **common)


def _rope_scaling(scaling: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """HF's `rope_scaling` with its kind under "rope_type" (older configs say "type")."""
    if not scaling:
        return None
    scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
    scaling["rope_type"] = scaling.pop("type", None) or scaling.get("rope_type", "default")
    return None if scaling["rope_type"] == "default" else scaling
