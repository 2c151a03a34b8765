"""gimlet-tvm's own ONNX converters, one module per op family, installed by `frontend.py`."""

from . import attention, constants, registry

MODULES = (attention, constants)
