"""Where an engine's VM, weights and KV cache live: this process, or a TVM RPC server (another
process or machine, `gimlet-tvm rpc server`).

The engine talks to both the same way: VM builtins by name, shapes and parameter tuples made on
the host's side, results taken apart there, and every remote step under the device's deadline
(`RemoteDevice.call`), so a server that dies is a `RemoteDeviceError`, never a hang. Over RPC
only tensors and object handles cross the wire: a shape or a list has to be built where it is
used, which is why the host makes them.
"""

from __future__ import annotations

import gc
import os
import tempfile
from typing import Any, Callable, Sequence

import tvm

from ..errors import LLMError
from ..runtime.remote import CALL_WITH_TENSORS, OWNED_ARRAY, RemoteDevice
from .compile import CompiledLLM


class LocalHost:
    """The engine in this process, on the compiled target's device here."""

    def __init__(self, compiled: CompiledLLM):
        runtime = compiled.runtime
        reason = runtime.cannot_run()
        if reason is not None:
            raise LLMError(f"the model is compiled for {runtime.name}, which cannot run here: {reason}")
        runtime.load_libraries()
        self.device = runtime.device()
        # As an Executable, linked where it is not yet (the objects of kernels from outside the
        # compiler, which kernel selection may have chosen): a module loaded from a file is as it was.
        self.module = tvm.runtime.Executable(compiled.module).jit()
        self.name = runtime.name

    def function(self, name: str) -> Callable[..., Any]:
        return tvm.get_global_func(name)

    function_taking_tensors = function

    def guard(self, step: str, run: Callable[[], Any]) -> Any:
        return run()

    def shape(self, values: Sequence[int]) -> Any:
        return tvm.runtime.ShapeTuple(values)

    def params(self, tensors: list) -> Any:
        return tensors

    def item(self, result: Any, index: int) -> Any:
        return result[index]

    def close(self) -> None:
        pass


class RemoteHost:
    """The engine on an RPC server: the compiled artifact is uploaded and loaded there, weights
    and KV pages are copied to its device once, and each step is a remote call."""

    def __init__(self, compiled: CompiledLLM, remote: RemoteDevice):
        self.remote = remote
        self.session = remote.connect()
        with tempfile.TemporaryDirectory(prefix="gimlet-llm-") as folder:
            path = compiled.file or os.path.join(folder, "llm.so")
            if compiled.file is None:
                compiled.export(path)
            self.guard("upload", lambda: self.session.upload(path, "llm.so"))
        self.module = self.guard("load", lambda: self.session.load_module("llm.so"))
        self.device = self.session.device(compiled.target["device_type"], 0)
        self.name = f"{compiled.runtime.name} on {remote.describe()}"
        self._shape = self.function("ffi.Shape")
        self._owned_array = self.function(OWNED_ARRAY)
        self._item = self.function("ffi.ArrayGetItem")

    def function(self, name: str) -> Callable[..., Any]:
        """The server's function `name`."""
        remote_function = self.guard(f"find {name}", lambda: self.session.get_function(name))
        return lambda *args: self.guard(name, lambda: remote_function(*args))

    def function_taking_tensors(self, name: str) -> Callable[..., Any]:
        """The server's function `name` whose parameters are typed `ffi.Tensor`, called
        through the server's adapter (`runtime.remote.CALL_WITH_TENSORS`)."""
        call = self.guard(f"find {name}", lambda: self.session.get_function(CALL_WITH_TENSORS))
        return lambda *args: self.guard(name, lambda: call(name, *args))

    def guard(self, step: str, run: Callable[[], Any]) -> Any:
        return self.remote.call(step, run)

    def shape(self, values: Sequence[int]) -> Any:
        return self._shape(*values)

    def params(self, tensors: list) -> Any:
        """The parameter tuple, holding the server's own copies of the tensors."""
        return self._owned_array(*tensors)

    def item(self, result: Any, index: int) -> Any:
        return self._item(result, index)

    def close(self) -> None:
        """Let the session go (TVM's RPC objects hold it in reference cycles)."""
        self.session = self.module = self.device = None
        gc.collect()
