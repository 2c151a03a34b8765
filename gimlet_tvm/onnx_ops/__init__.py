"""gimlet-tvm's own ONNX converters, one module per op family, installed by `frontend.py`."""

from . import attention, bitwise, constants, guards, reduce, registry

MODULES = (attention, bitwise, constants, guards, reduce)
