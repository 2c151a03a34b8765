"""Weights kept quantized in memory (filled in below)."""

from __future__ import annotations

from .families.base import DecoderLM

QUANTIZATIONS = (None,)


def quantize_module(model: DecoderLM, quantization: str | None) -> None:
    """Swap the model's linear layers for quantized ones (None: keep them float)."""
