"""What a failed index check in a kernel means: the message the kernel raises, and the
`InputError` a run turns it into; the same for a converter's check of other run-time values
(a size, a step: `value_check_message`).

`relax_passes.checked_indexing` compiles every index a kernel reads from a run-time tensor
with a bounds check that raises `IndexError` with a constant message (`check_message`). The
kernel cannot say which value failed, so on that error path only the run rescans the input
the indices came from (when they came from one) for a value outside its axis
(`input_error`); the good path costs nothing here.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Mapping, Sequence

import numpy as np

from ..errors import InputError

_TAG = "gimlet-index-check"
_PATTERN = re.compile(rf"{_TAG} op=(\w+) input=(\S*) extents=(\S+) per=(axis|element)")
_VALUE_TAG = "gimlet-value-check"
_VALUE_PATTERN = re.compile(rf"{_VALUE_TAG} op=(\w+) problem=([^\n']*)")


@dataclasses.dataclass(frozen=True)
class FailedCheck:
    """A failed index check: the ONNX op, the model input its indices came from (None when
    computed in the model), the extents of the indexed axes (None where only known at run
    time) and how they apply: one extent to every element (`per="element"`), or one per
    position of the indices' last axis (`per="axis"`: GatherND, ScatterND coordinates)."""

    op: str
    input: str | None
    extents: tuple[int | None, ...]
    per: str

    def offending(self, indices: np.ndarray) -> tuple[tuple[int, ...], int, int] | None:
        """(position, value, extent) of the first index outside [-extent, extent), if the
        extents are known."""
        if any(extent is None for extent in self.extents):
            return None
        values = np.asarray(indices).astype(np.int64)
        bounds = np.asarray(self.extents, dtype=np.int64)
        if self.per == "element":
            bounds = np.broadcast_to(bounds[0], values.shape)
        elif values.ndim == 0 or values.shape[-1] != len(self.extents):
            return None
        else:
            bounds = np.broadcast_to(bounds, values.shape)
        bad = np.argwhere((values < -bounds) | (values >= bounds))
        if not len(bad):
            return None
        position = tuple(int(i) for i in bad[0])
        return position, int(values[position]), int(bounds[position])


def check_message(op: str, source: str | None, extents: Sequence[int | None], per: str) -> str:
    """The constant message a kernel's index check raises (read back by `parse`)."""
    listed = ",".join("?" if extent is None else str(extent) for extent in extents)
    return f"{_TAG} op={op} input={source or ''} extents={listed} per={per}"


def value_check_message(op: str, problem: str) -> str:
    """The constant message a converter's check of run-time values raises (`relax_passes.
    checked_indexing.require`): the op and what its values must satisfy."""
    assert "'" not in problem and "\n" not in problem, "the message is read back up to a quote or a line end"
    return f"{_VALUE_TAG} op={op} problem={problem}"


def parse(text: str) -> FailedCheck | None:
    """The failed check an error message names, or None when it is not one of ours."""
    found = _PATTERN.search(text)
    if found is None:
        return None
    op, source, listed, per = found.groups()
    extents = tuple(None if extent == "?" else int(extent) for extent in listed.split(","))
    return FailedCheck(op, source or None, extents, per)


def input_error(err: BaseException, inputs: Mapping[str, np.ndarray]) -> InputError | None:
    """The `InputError` for a kernel's failed index check (`inputs`: the run's inputs by
    name), or None when `err` is something else."""
    text = str(err)
    value_check = _VALUE_PATTERN.search(text)
    if value_check is not None:
        op, problem = value_check.groups()
        return InputError(f"{op}: {problem} (values given or computed at run time)")
    failed = parse(text)
    if failed is None:
        return None
    what = f"{failed.op}: an index is outside the indexed axis"
    if failed.input is None:
        return InputError(f"{what} (the indices are computed in the model from the inputs; "
                          f"axis extents {_listed(failed.extents)})")
    found = failed.offending(inputs[failed.input]) if failed.input in inputs else None
    if found is None:
        return InputError(f"{what}: input '{failed.input}' (axis extents {_listed(failed.extents)})")
    position, value, extent = found
    return InputError(f"{failed.op}: input '{failed.input}' holds index {value} at {list(position)}, "
                      f"outside [-{extent}, {extent}) for an axis of {extent}")


def _listed(extents: Sequence[int | None]) -> str:
    return ", ".join("run-time" if extent is None else str(extent) for extent in extents)
