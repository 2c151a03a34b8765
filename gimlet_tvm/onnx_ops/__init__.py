"""gimlet-tvm's own ONNX converters, one module per op family, installed by `frontend.py`."""

from . import attention, bitwise, constants, guards, llm, losses, normalization, recurrent, reduce, registry, shapes

MODULES = (attention, bitwise, constants, guards, llm, losses, normalization, recurrent, reduce, shapes)
