"""The artifact: one file that is both a loadable shared library and its own description.

Layout: the shared library TVM exports (host code with device code embedded), then the
metadata as UTF-8 JSON, then a fixed footer: the JSON's length (8 bytes, little endian) and a
magic string. The dynamic loader ignores bytes past the ELF image, so the file loads as-is.
The metadata records the library's SHA-256 and its own (of the rest of the metadata, as
`json.dumps(sort_keys=True)` writes it), so a truncated or altered file is rejected before it
is handed to the loader. (Artifacts written before the metadata's own checksum load unchecked
there.)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from typing import Any, Callable

from ..errors import ArtifactError
from ..files import atomic_path

FORMAT_VERSION = 1
MAGIC = b"\0GIMLET-TVM-ARTIFACT-1"
_LENGTH = struct.Struct("<Q")
_FOOTER_SIZE = _LENGTH.size + len(MAGIC)
METADATA_SHA256 = "metadata_sha256"


def _metadata_sha256(meta: dict) -> str:
    """The checksum of the metadata but its own."""
    rest = {key: value for key, value in meta.items() if key != METADATA_SHA256}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


def write(path: str | os.PathLike, export_library: Callable[[str], None], metadata: dict) -> None:
    """Write an artifact atomically: `export_library(tmp_path)` writes the shared library.

    Nothing is left at `path` unless the whole artifact was written.
    """
    with atomic_path(path, suffix=".so") as tmp:
        export_library(tmp)
        with open(tmp, "rb") as f:
            library_sha256 = hashlib.sha256(f.read()).hexdigest()
        meta = dict(metadata, format=FORMAT_VERSION, library_sha256=library_sha256)
        meta[METADATA_SHA256] = _metadata_sha256(meta)  # (over the rest, a stale one left out)
        blob = json.dumps(meta, sort_keys=True).encode()
        with open(tmp, "ab") as f:
            f.write(blob + _LENGTH.pack(len(blob)) + MAGIC)


def copy(source: str | os.PathLike, path: str | os.PathLike) -> None:
    """Copy an artifact atomically, after checking it."""
    read_metadata(source)
    with atomic_path(path, suffix=".so") as tmp:
        shutil.copyfile(source, tmp)


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The artifact's metadata, after checking its footer and the library's checksum."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ArtifactError(f"artifact not found: {path}")
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < _FOOTER_SIZE or not data.endswith(MAGIC):
        raise ArtifactError(f"not a gimlet-tvm artifact (no metadata footer): {path}")
    (length,) = _LENGTH.unpack(data[-_FOOTER_SIZE : -len(MAGIC)])
    library_end = len(data) - _FOOTER_SIZE - length
    if library_end <= 0:
        raise ArtifactError(f"corrupt artifact (metadata length out of range): {path}")
    try:
        meta = json.loads(data[library_end : len(data) - _FOOTER_SIZE])
    except ValueError:
        raise ArtifactError(f"corrupt artifact (metadata is not JSON): {path}") from None
    if not isinstance(meta, dict):
        raise ArtifactError(f"corrupt artifact (metadata is not a JSON object): {path}")
    if METADATA_SHA256 in meta and meta[METADATA_SHA256] != _metadata_sha256(meta):
        raise ArtifactError(f"corrupt artifact (metadata checksum mismatch): {path}")
    if meta.get("format") != FORMAT_VERSION:
        raise ArtifactError(
            f"artifact format {meta.get('format')} is not supported (this version reads "
            f"{FORMAT_VERSION}): {path}"
        )
    if hashlib.sha256(data[:library_end]).hexdigest() != meta.get("library_sha256"):
        raise ArtifactError(f"corrupt artifact (library checksum mismatch): {path}")
    return meta
