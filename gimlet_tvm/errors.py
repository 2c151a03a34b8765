"""Typed errors users can catch; the CLI prints each as one line and exits with code 2."""


def summary(err: BaseException) -> str:
    """One line naming a foreign error: its type and the first line of its message."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


class GimletError(Exception):
    """Base class of every error gimlet-tvm raises on bad input."""


class ModelLoadError(GimletError):
    """The model file is missing, unreadable or not a valid ONNX model."""


class UnsupportedOpError(GimletError):
    """The model uses operators the importer cannot convert.

    `ops` maps each unsupported op type to the names of the nodes that use it.
    """

    def __init__(self, ops: dict[str, list[str]]):
        self.ops = ops
        listed = "; ".join(
            f"{op} (nodes: {', '.join(names[:5])}{', ...' if len(names) > 5 else ''})"
            for op, names in sorted(ops.items())
        )
        super().__init__(f"unsupported ONNX operators: {listed}")


class ModelImportError(GimletError):
    """A supported operator failed to convert (bad attributes, shapes the importer rejects)."""


class CompileError(GimletError):
    """TVM failed to compile an imported model for the target."""


class UnknownTargetError(GimletError):
    """The requested target is not registered."""


class InputError(GimletError):
    """Run-time inputs do not match the model: wrong name, count, shape or dtype."""


class RunError(GimletError):
    """Running a compiled model failed inside TVM's runtime although its inputs fit the
    interface (a check of the executable's own, e.g. against an interface edited in the
    artifact, or a model computing something TVM refuses at run time); names TVM's message."""


class ArtifactError(GimletError):
    """A compiled artifact is missing, corrupt or was built by an incompatible version."""


class TargetUnavailableError(GimletError):
    """This machine lacks what the target needs to compile (a toolchain) or to run (a device)."""


class CodeCheckError(GimletError):
    """Generated code failed its check by the target's own tools (missing kernels, wrong arch)."""


class UnsafeKernelError(GimletError):
    """A kernel from outside the compiler (external or generated) calls what a kernel may not:
    anything beyond libc's memory functions and libm (processes, files, network, ...)."""


class RemoteDeviceError(GimletError):
    """A remote device (TVM RPC) failed or stopped answering; names the device and the step."""


class RPCAuthError(RemoteDeviceError):
    """An authenticated RPC server or tracker refused the client (no key, a wrong one, a key file
    that is unreadable or too short), or the other side did not prove it holds the key."""


class LLMError(GimletError):
    """A language-model request is invalid: an empty prompt, a token id outside the vocabulary,
    a prompt longer than the context window, bad sampling parameters."""


class WeightsError(GimletError):
    """An LLM checkpoint is unreadable, truncated, or does not fit the architecture (names the
    tensor), or uses an architecture or tensor type that is not supported (lists what is)."""


class ResourceLimitError(GimletError):
    """A model's declared sizes need more memory than this machine has available: refused up
    front (with the figure needed, what is available and the biggest tensor) rather than by the
    OOM killer."""
