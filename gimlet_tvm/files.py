"""Writing files so that a failure never leaves a half-written one behind."""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Iterator


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = "") -> Iterator[str]:
    """A temporary file beside `path` to write; on success it is synced and renamed onto
    `path`, on failure removed. `suffix` is for tools that pick a format by file name."""
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(prefix=".gimlet-", suffix=suffix, dir=os.path.dirname(os.path.abspath(path)))
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
