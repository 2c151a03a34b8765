"""The kernels a build runs where no kernel selection chose: the target's built-in rule
(`TargetSpec.default_kernel`, e.g. the CPU's packed GEMM for linear layers of enough rows), so
that a user who never runs `gimlet-tvm select` still gets the fast path. The rule names a
candidate; the build applies it through the same pass as a selection's winners
(`ApplyKernelSelection`, before the library passes), so a constant weight a kernel takes packed
is packed once, at build time. A selection's entries win over the rule, op group by op group;
an op group the rule names nothing for, or whose named candidate cannot take it (an epilogue it
does not fuse), keeps the target's ordinary path (library call, default schedules).
`$GIMLET_TVM_DEFAULT_KERNELS=0` turns the rule off.
"""

from __future__ import annotations

import os

import tvm

from ...errors import GimletError
from ...targets import spec_for
from .apply import ApplyKernelSelection
from .candidates import Candidate, OpSignature
from .choices import KernelSelection
from .sources import find

DEFAULT_KERNELS_ENV = "GIMLET_TVM_DEFAULT_KERNELS"
"""Set to 0 to build without the targets' default kernels (each op group on the target's
ordinary path unless a selection chose for it); any other value, or none, keeps them."""


def default_kernels_on() -> bool:
    """Whether builds apply the targets' default kernels."""
    return os.environ.get(DEFAULT_KERNELS_ENV, "1").strip() != "0"


class DefaultKernels:  # pylint: disable=too-few-public-methods
    """A `Choose` for `target`: the candidate its spec's rule names for an op group, where that
    candidate takes it; `chosen`: how many op groups it gave one."""

    def __init__(self, target: tvm.target.Target) -> None:
        self.target = target
        self.rule = spec_for(target).default_kernel
        self.chosen = 0

    def __call__(self, sig: OpSignature) -> Candidate | None:
        candidate_id = self.rule(self.target, sig)
        if candidate_id is None:
            return None
        try:
            candidate = find(candidate_id, sig, self.target)
        except KeyError:
            raise GimletError(f"the default kernel {candidate_id} for {sig.key} is not offered "
                              f"on {self.target}") from None
        if candidate.unavailable is not None:
            return None
        self.chosen += 1
        return candidate


def kernel_choices(selection: KernelSelection | None, target: tvm.target.Target
                   ) -> tuple[ApplyKernelSelection | None, DefaultKernels | None]:
    """The build's pass rewriting op groups into chosen kernels on `target` (the selection's
    winners, else the default kernels), and the default kernels' chooser (its count); None for
    either when there is nothing of it to apply."""
    defaults = DefaultKernels(target) if default_kernels_on() else None
    if selection is None:
        return (ApplyKernelSelection(defaults, target) if defaults is not None else None), defaults
    return selection.pass_for(target, otherwise=defaults), defaults
