"""gimlet-tvm's own ONNX converters, one module per op family, installed by `frontend.py`."""

from . import attention, constants, guards, reduce, registry

MODULES = (attention, constants, guards, reduce)
