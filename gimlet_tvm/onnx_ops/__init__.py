"""gimlet-tvm's own ONNX converters, one module per op family, installed by `frontend.py`."""

from . import attention, bitwise, constants, guards, losses, normalization, reduce, registry, shapes

MODULES = (attention, bitwise, constants, guards, losses, normalization, reduce, shapes)
