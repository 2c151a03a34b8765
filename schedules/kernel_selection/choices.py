"""A model's kernel choices, as stored and applied: `KernelSelection`.

One `OpChoice` per op signature: every candidate as it was tried (verified or not, with the
reason, its time and digest), the kernel generator's rounds where one ran, and the winner's id. The choices of each target are kept with
provenance in the records directory as `gimlet_kernel_selection.json` (beside MetaSchedule's
files, under the same lock, written atomically), per target key; `pass_for` is the build pass
that rewrites each op group into its winner (a winner whose source changed since it was
verified, or that is no longer offered, is refused), the op groups it has no entry for into
the target's default kernels (`defaults`). Making the choices is
`gimlet_tvm.selection`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import tvm

from ...errors import GimletError
from ...files import atomic_path
from ..tuning.records import RecordsDB, target_key
from .apply import ApplyKernelSelection, Choose
from .candidates import Candidate, OpSignature
from .sources import find

SELECTION_FILE = "gimlet_kernel_selection.json"
FORMAT = "gimlet-tvm-kernel-selection/1"


@dataclasses.dataclass
class Tried:
    """One candidate of one op and what its verification and timing gave."""

    id: str
    provenance: str
    verified: bool
    reason: str = ""
    seconds: float | None = None  # raced: the median of `rounds`
    digest: str = ""
    rounds: list[float] = dataclasses.field(default_factory=list)  # seconds in each round of the race
    verdict: str = ""  # the reason's kind (`gimlet_tvm.selection.verify.VERDICTS`); "" in older records
    cached: bool = False  # a generated kernel verified in an earlier selection (`gimlet_tvm.selection.accepted`)


@dataclasses.dataclass
class GeneratorRound:
    """One round of a kernel generator on one op group: the candidates it gave (their ids,
    tried as `Tried`), or why the round failed (bad output, timeout, non-zero exit)."""

    round: int
    candidates: list[str]
    failure: str = ""
    seconds: float = 0.0  # the generator's own time


@dataclasses.dataclass
class OpChoice:
    """An op signature, its candidates as tried, and the winner's id (None: none verified)."""

    signature: OpSignature
    tried: list[Tried]
    winner: str | None
    count: int = 1  # how often the op occurs in the model
    generator_rounds: list[GeneratorRound] = dataclasses.field(default_factory=list)

    def best_of(self, source: str) -> str | None:
        """The fastest verified candidate of one source."""
        verified = [t for t in self.tried if t.verified and t.id.startswith(source + ":")]
        return min(verified, key=lambda t: t.seconds).id if verified else None

    def to_json(self) -> dict[str, Any]:
        return {"signature": self.signature.to_json(), "winner": self.winner, "count": self.count,
                "tried": [dataclasses.asdict(t) for t in self.tried],
                "generator_rounds": [dataclasses.asdict(r) for r in self.generator_rounds]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> OpChoice:
        return cls(OpSignature.from_json(data["signature"]), [Tried(**t) for t in data["tried"]],
                   data["winner"], data.get("count", 1),
                   [GeneratorRound(**r) for r in data.get("generator_rounds", [])])


@dataclasses.dataclass
class KernelSelection:
    """The choices for one target: op key -> OpChoice, and where external and generated
    kernels live."""

    target: str
    choices: dict[str, OpChoice]
    external_dir: str | None = None
    measured: str = ""
    device: str = "local"  # where the times were measured: "local", or the remote device
    generated_dir: str | None = None

    def restricted_to(self, source: str) -> KernelSelection:
        """The same ops, each with its fastest verified candidate of `source` (none: default)."""
        choices = {key: dataclasses.replace(c, winner=c.best_of(source)) for key, c in self.choices.items()}
        return dataclasses.replace(self, choices=choices)

    def pass_for(self, target: tvm.target.Target, otherwise: Choose | None = None) -> ApplyKernelSelection:
        """The build pass applying the winners on `target`; an op group the selection has no
        entry for gets what `otherwise` chooses (the target's default kernels), if given."""
        if target_key(target) != self.target:
            raise GimletError(f"kernel selection was made for {self.target}, not {target_key(target)}")

        def choose(sig: OpSignature) -> Candidate | None:
            if sig.key in self.choices or otherwise is None:
                return self.winner(sig, target)
            return otherwise(sig)

        return ApplyKernelSelection(choose, target)

    def winner(self, sig: OpSignature, target: tvm.target.Target) -> Candidate | None:
        choice = self.choices.get(sig.key)
        if choice is None or choice.winner is None:
            return None
        try:
            candidate = find(choice.winner, sig, target, self.external_dir, self.generated_dir)
        except KeyError:
            raise GimletError(f"kernel {choice.winner}, selected for {sig.key}, is no longer offered; "
                              "run `gimlet-tvm select` again") from None
        tried = next(t for t in choice.tried if t.id == choice.winner)
        if candidate.digest != tried.digest:
            raise GimletError(f"kernel {candidate.provenance} changed since it was verified for "
                              f"{sig.key}; run `gimlet-tvm select` again")
        return candidate

    def to_json(self) -> dict[str, Any]:
        return {"external_dir": self.external_dir, "generated_dir": self.generated_dir,
                "measured": self.measured, "device": self.device,
                "ops": {key: c.to_json() for key, c in self.choices.items()}}

    @classmethod
    def from_json(cls, target: str, data: dict[str, Any]) -> KernelSelection:
        choices = {key: OpChoice.from_json(c) for key, c in data["ops"].items()}
        return cls(target, choices, data.get("external_dir"), data.get("measured", ""),
                   data.get("device", "local"), data.get("generated_dir"))

    @classmethod
    def load(cls, records: str | os.PathLike, target: tvm.target.Target) -> KernelSelection | None:
        """The selection stored in a records directory for `target`, or None."""
        path = os.path.join(os.fspath(records), SELECTION_FILE)
        if not os.path.isfile(path):
            return None
        try:
            with open(path) as f:
                data = json.load(f)
            entry = data["targets"].get(target_key(target))
        except (OSError, ValueError, KeyError, AttributeError) as err:
            raise GimletError(f"cannot read kernel selection {path}: {err}") from None
        return None if entry is None else cls.from_json(target_key(target), entry)

    def save(self, records: str | os.PathLike) -> str:
        """Store this target's entry in the records directory (other targets' entries kept)."""
        db = RecordsDB(records, create=True)
        path = os.path.join(db.path, SELECTION_FILE)
        with db.locked():
            data = {"format": FORMAT, "targets": {}}
            if os.path.isfile(path):
                with open(path) as f:
                    data = json.load(f)
            data["targets"][self.target] = self.to_json()
            with atomic_path(path) as tmp, open(tmp, "w") as f:
                json.dump(data, f, indent=1)
        return path
