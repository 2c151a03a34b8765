"""gimlet-tvm's own ONNX converters, one module per op family, installed by `frontend.py`.

Every public module of this package is a family; `registry.converters_of` collects the
converter classes each defines (an op defined in two families is an error).
"""

import importlib
import pkgutil

MODULES = tuple(
    importlib.import_module(f"{__name__}.{info.name}")
    for info in pkgutil.iter_modules(__path__)
    if not info.name.startswith("_")
)
