"""The registry of a run's stateful parts: what a checkpoint saves beside the weights, what resume restores,
and what an interrupted step rewinds.

Each part is registered once, by name, with how to read and restore its state; save, resume, snapshot and
rewind iterate over the registry. The names are the keys a checkpoint's `trainer_state.pt` holds under
`extra` (and, for a part of its own process, under `rank-R.pt` when several processes write), so a
checkpoint of an older cohort loads as long as the names stay. The weights (policy, optimizer, a reference
copy) are the checkpoint module's, not parts: they are sharded or whole depending on the strategy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


class Stateful(Protocol):
    """An object whose state round-trips through state_dict / load_state_dict."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


@dataclass(frozen=True)
class Part:
    """One stateful part: how to read and restore it, and where its state belongs."""

    name: str
    read: Callable[[], Any]
    restore: Callable[[Any], object]
    per_process: bool  # each process holds its own (a rank-R.pt of a multi-process checkpoint)
    rewinds: bool  # preparing a step changes it: an interrupted preparation restores it
    file: (
        str | None
    )  # saved as a file of its own in the checkpoint (large tensors), not inside trainer_state.pt
    mark: Callable[[], Any] | None = None  # a cheap snapshot where `read` would cost (rewinds via `back`)
    back: Callable[[Any], object] | None = None


class StateRegistry:
    """The stateful parts of a run, registered once; checkpoints, resume and rewinds go through it."""

    def __init__(self) -> None:
        self._parts: dict[str, Part] = {}

    def register(
        self,
        name: str,
        obj: Stateful | None = None,
        *,
        read: Callable[[], Any] | None = None,
        restore: Callable[[Any], object] | None = None,
        per_process: bool = False,
        rewinds: bool = False,
        file: str | None = None,
        mark: Callable[[], Any] | None = None,
        back: Callable[[Any], object] | None = None,
    ) -> None:
        """Adds a part: an object with state_dict/load_state_dict, or a `read` and `restore` pair; a rewinding
        part whose `read` is costly (it waits for work in flight) gives `mark` and `back` for its snapshots."""
        if name in self._parts:
            raise ValueError(f"a stateful part named {name!r} is already registered")
        if obj is not None:
            read, restore = obj.state_dict, obj.load_state_dict
        if read is None or restore is None:
            raise ValueError(
                f"stateful part {name!r}: pass an object with state_dict/load_state_dict, or read and restore"
            )
        if file is not None and (per_process or rewinds):
            raise ValueError(
                f"stateful part {name!r}: a part saved as its own file is shared and not rewound"
            )
        if (mark is None) != (back is None) or (mark is not None and not rewinds):
            raise ValueError(f"stateful part {name!r}: mark and back come together, on a part that rewinds")
        self._parts[name] = Part(name, read, restore, per_process, rewinds, file, mark, back)

    def names(self) -> list[str]:
        """Returns the registered parts' names in registration order."""
        return list(self._parts)

    def state_dict(self, *, per_process: bool | None = None) -> dict[str, Any]:
        """Returns {name: state} of the parts kept inside trainer_state.pt (all, or only shared / per-process ones)."""
        return {
            p.name: p.read()
            for p in self._parts.values()
            if p.file is None and (per_process is None or p.per_process == per_process)
        }

    def file_names(self) -> list[str]:
        """Returns the file names of the parts saved as files of their own."""
        return [p.file for p in self._parts.values() if p.file is not None]

    def files(self) -> dict[str, Any]:
        """Returns {file name: state} of the parts saved as files of their own."""
        return {p.file: p.read() for p in self._parts.values() if p.file is not None}

    def load_state_dict(self, state: dict[str, Any], *, per_process: bool | None = None) -> list[str]:
        """Restores every part `state` holds (all, or only shared / per-process ones); returns the names it lacked.

        A part a checkpoint lacks keeps its fresh state: the checkpoint predates it, or it was off then."""
        missing = []
        for p in self._parts.values():
            if p.file is not None or (per_process is not None and p.per_process != per_process):
                continue
            if state.get(p.name) is None:
                missing.append(p.name)
                continue
            p.restore(state[p.name])
        return missing

    def load_files(self, read: Callable[[str], Any | None]) -> None:
        """Restores the parts saved as files, each from `read(file name)` (None: the checkpoint has no such file)."""
        for p in self._parts.values():
            if p.file is not None:
                value = read(p.file)
                if value is not None:
                    p.restore(value)

    def snapshot(self) -> dict[str, Any]:
        """Returns the state of the parts that preparing a step changes (see `rewind`)."""
        return {p.name: (p.mark or p.read)() for p in self._parts.values() if p.rewinds}

    def rewind(self, snap: dict[str, Any]) -> None:
        """Restores a `snapshot`: the state at the start of the step being prepared."""
        for name, value in snap.items():
            part = self._parts[name]
            (part.back or part.restore)(value)
