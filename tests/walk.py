"""A request's walk through the house: which rooms its code enters, and from where.

A room is a top-level module or package of batchserve, as `tests/test_imports.py` layers them
(`server/grpc/convert.py` is in "server"). The walk follows every call from code in one room
into code in another, on every thread that runs while the tracer is on (the step thread, the
preparation and grammar threads); calls into other code (the standard library, torch,
tokenizers) and dataclasses' generated methods are not batchserve's code and do not count.

A room is entered once from each other room whose code calls into it: a door the request walks
through, which a reader following it meets. Walking through one door many times (a loop, every
step, a helper and its caller) is one entry. Records (`RECORDS`) are what the walk carries, read
wherever it goes; they are not rooms."""

from __future__ import annotations

import sys
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import batchserve

PACKAGE = Path(batchserve.__file__).parent
# Data the request and its steps carry: parameters, settings, a step's records, draft trees.
RECORDS = frozenset({"request", "records", "trees", "config", "draft_config", "settings", "cost_profile"})


def module_of(filename: str) -> str | None:
    """`.../batchserve/server/grpc/convert.py` -> "server/grpc/convert"; None outside batchserve and for its protos."""
    try:
        rel = Path(filename).relative_to(PACKAGE)
    except ValueError:
        return None
    if rel.parts[0] == "v1":  # generated protobuf code
        return None
    return rel.with_suffix("").as_posix()


def room_of(module: str) -> str:
    return module.split("/")[0]


@dataclass
class Walk:
    """The calls between rooms recorded between `start` and `stop`, and the sequence of rooms entered."""

    calls: set[tuple[str, str, str]] = field(default_factory=set)  # (caller module, caller function, callee module)
    path: list[str] = field(default_factory=list)  # rooms in the order they were first entered from each module
    on: bool = False

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.on or event != "call":
            return
        callee = module_of(frame.f_code.co_filename)
        if callee is None:
            return
        caller_frame = frame.f_back
        while caller_frame is not None and module_of(caller_frame.f_code.co_filename) is None:
            caller_frame = caller_frame.f_back
        if caller_frame is None:
            return
        caller = module_of(caller_frame.f_code.co_filename)
        assert caller is not None
        if room_of(caller) == room_of(callee):
            return
        call = (caller, caller_frame.f_code.co_qualname, callee)
        if call not in self.calls:
            self.calls.add(call)
            self.path.append(f"{caller}:{caller_frame.f_code.co_qualname} -> {callee}:{frame.f_code.co_qualname}")

    def install(self) -> None:
        """Trace this thread and every thread started from now on (install before building the server)."""
        sys.setprofile(self._profile)
        threading.setprofile(self._profile)

    def uninstall(self) -> None:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]

    def start(self) -> None:
        self.calls.clear()
        self.path.clear()
        self.on = True

    def stop(self) -> None:
        self.on = False

    def entries(self) -> dict[str, set[str]]:
        """Each room the walk entered (records aside) and the rooms it was entered from."""
        rooms: dict[str, set[str]] = defaultdict(set)
        for caller, _, callee in self.calls:
            if room_of(callee) not in RECORDS:
                rooms[room_of(callee)].add(room_of(caller))
        return dict(rooms)

    def report(self) -> str:
        doors = sorted(self.entries().items())
        lines = [f"{room}: entered from {len(c)} ({', '.join(sorted(c))})" for room, c in doors]
        return "\n".join([*lines, "", "first calls, in order:", *self.path])
