"""Generated kernels that passed verification, by content hash, with their provenance.

A kernel generator often gives the same kernel again: in a later round, or when `select` runs
again on the same model (a search generator is deterministic; a model's answer may repeat).
Verifying it once more costs builds and runs in a child process and tells nothing new, so each
accepted kernel is recorded in the generated-kernel directory's `accepted.json` under the hash
of everything its verdict depends on (`content_hash`: the op group, the target, the format,
the source, its tasks, the C compiler's flags, and the checks the verifier makes,
`verify.KERNEL_CHECKS`: a verifier that checks more verifies it again), with its provenance:
the generator command, the round, when, the checks it passed, its time. Only accepted kernels
are kept: a rejected one is verified again (its failure is what the generator must be told,
and a better verifier may judge it anew). A cached kernel keeps the time it was measured at
then; where it is close to the fastest, the race (`select._race_close`) times it again beside
the others.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from typing import Any

import tvm

from ..errors import GimletError
from ..files import atomic_path
from ..schedules.kernel_selection.candidates import OpSignature
from ..schedules.kernel_selection.external import C_FLAGS
from ..schedules.tuning.records import target_key
from .verify import KERNEL_CHECKS, Outcome

CACHE_FILE = "accepted.json"
FORMAT = "gimlet-tvm-accepted-kernels/1"


def content_hash(sig: OpSignature, target: tvm.target.Target, fmt: str, source: str, tasks: int = 1) -> str:
    """The hash of everything a generated kernel's verdict depends on."""
    text = json.dumps([sig.key, target_key(target), fmt, source, list(KERNEL_CHECKS), list(C_FLAGS),
                       *([tasks] if tasks != 1 else [])])
    return hashlib.sha256(text.encode()).hexdigest()


class AcceptedKernels:
    """`directory`'s record of accepted generated kernels (`CACHE_FILE`)."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, CACHE_FILE)

    def _entries(self) -> dict[str, dict[str, Any]]:
        if not os.path.isfile(self.path):
            return {}
        try:
            with open(self.path) as f:
                return json.load(f)["kernels"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise GimletError(f"cannot read the accepted-kernel cache {self.path}: {err}") from None

    def get(self, digest: str) -> dict[str, Any] | None:
        """The provenance of the accepted kernel of this `content_hash`, or None."""
        return self._entries().get(digest)

    def add(self, digest: str, name: str, outcome: Outcome, generator: str, round_: int) -> None:
        """Record a kernel `outcome` accepted (written atomically; another selection writing at
        once may lose its entry, which only means that kernel is verified again)."""
        entries = self._entries()
        entries[digest] = {"name": name, "generator": generator, "round": round_, "checks": list(KERNEL_CHECKS),
                           "shapes_checked": outcome.checks, "seconds": outcome.seconds,
                           "verified": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with atomic_path(self.path) as tmp, open(tmp, "w") as f:
            json.dump({"format": FORMAT, "kernels": entries}, f, indent=1)
