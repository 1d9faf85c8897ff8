"""The measured cost of a forward step on one device: `CostProfile`, its interpolation and JSON form.

`batchserve calibrate` measures it once per device, dtype and model: forward time against
tokens in the step, at a few context lengths, plus what each further request in a step adds
and what a draft row adds among many requests (uneven trees) beyond its share of the curve.
The draft budget policy (`budget.py`) reads it to trade draft tokens against milliseconds.
Pure Python and numpy.
"""

from __future__ import annotations

import bisect
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise linear; clamps below xs[0], extrapolates the last segment above xs[-1]."""
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    i = min(bisect.bisect_right(xs, x), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _interp_many(xs: Sequence[float], ys: Sequence[float], x: np.ndarray) -> np.ndarray:
    """`_interp` at every point of `x` at once."""
    out = np.interp(x, xs, ys)
    if len(xs) > 1:  # np.interp clamps above xs[-1] too: extrapolate the last segment there
        above = x > xs[-1]
        out[above] = ys[-1] + (ys[-1] - ys[-2]) * (x[above] - xs[-1]) / (xs[-1] - xs[-2])
    return out


def _per_context(value: Any, num_contexts: int) -> tuple[float, ...]:
    """Per-context costs; one number (older profiles) applies at every context."""
    if isinstance(value, (int, float)):
        return (float(value),) * num_contexts
    return tuple(float(x) for x in value)


@dataclass(frozen=True, slots=True)
class CostProfile:
    """Measured step time against tokens in the step (one sequence) at a few context lengths."""

    key: str  # device, dtype and model this was measured for
    token_counts: tuple[int, ...]  # ascending, tokens in the step
    contexts: tuple[int, ...]  # ascending, KV length each query token attends to
    step_ms: tuple[tuple[float, ...], ...]  # [context][token count] median milliseconds
    # [context] extra cost of each further request in a step: its own attention batch row,
    # the padding and gather of its KV, its metadata. Grows with context. Empty: none.
    per_seq_ms: tuple[float, ...] = ()
    # Rows the forward's products take in blocks of (measured by `calibrate`; 1: none): where a
    # kernel reads every weight again for each block (torch's int4 kernel on AVX2: 4 rows), a step
    # past the first block costs what its rows rounded up to a whole block cost, not a linear share.
    row_block: int = 1
    # [context] extra cost of each draft row in a step of several requests, beyond what the
    # one-request curve says for a row: requests carry drafts of different sizes and shapes
    # (trees), so attention pads or splits them into more groups; one request's chain, which
    # the curve measures, pays for neither. Empty: none (older profiles).
    draft_ms: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not self.token_counts or not self.contexts:
            raise ValueError("a cost profile needs at least one token count and one context")
        for name, xs in (("token_counts", self.token_counts), ("contexts", self.contexts)):
            if list(xs) != sorted(set(xs)) or xs[0] < 0:
                raise ValueError(f"{name} must be ascending and non-negative, got {xs}")
        if len(self.step_ms) != len(self.contexts) or any(len(r) != len(self.token_counts) for r in self.step_ms):
            raise ValueError("step_ms must be [len(contexts)][len(token_counts)]")
        if any(t <= 0 for row in self.step_ms for t in row) or any(t < 0 for t in (*self.per_seq_ms, *self.draft_ms)):
            raise ValueError("times must be positive")
        for name, per_context in (("per_seq_ms", self.per_seq_ms), ("draft_ms", self.draft_ms)):
            if per_context and len(per_context) != len(self.contexts):
                raise ValueError(f"{name} must have one entry per context")
        if self.row_block < 1:
            raise ValueError(f"row_block must be >= 1, got {self.row_block}")

    def curve(self, context: float = 0.0) -> np.ndarray:
        """[len(token_counts)] step time per `token_counts` entry at one context length
        (`_interp` of each column, in one set of array operations: the policy asks every step)."""
        xs, rows = self.contexts, np.asarray(self.step_ms)
        if len(xs) == 1 or context <= xs[0]:
            return rows[0]
        i = min(bisect.bisect_right(xs, context), len(xs) - 1)
        return rows[i - 1] + (rows[i] - rows[i - 1]) * (context - xs[i - 1]) / (xs[i] - xs[i - 1])

    def time_ms(
        self,
        num_tokens: float,
        context: float = 0.0,
        num_seqs: int = 1,
        curve: np.ndarray | None = None,
        draft_rows: float = 0.0,
    ) -> float:
        """Predicted forward time of a step with `num_tokens` rows from `num_seqs` requests
        whose mean context is `context` (pass `curve(context)` to skip recomputing it), of
        which `draft_rows` are draft rows."""
        return float(self.times_ms(np.array([num_tokens]), context, num_seqs, curve, np.array([draft_rows]))[0])

    def times_ms(
        self,
        num_tokens: np.ndarray,
        context: float = 0.0,
        num_seqs: int = 1,
        curve: np.ndarray | None = None,
        draft_rows: np.ndarray | None = None,
    ) -> np.ndarray:
        """`time_ms` at every row count of `num_tokens` (and its `draft_rows`) at once: the
        budget weighs every draft length of a step."""
        ys = curve if curve is not None else self.curve(context)
        x = np.asarray(num_tokens, dtype=float)
        b = self.row_block
        if b > 1:
            x = np.where(x > b, np.ceil(x / b) * b, x)
        out = _interp_many(self.token_counts, ys, x) + self.seq_ms(context) * max(0, num_seqs - 1)
        if draft_rows is not None and num_seqs > 1:
            out = out + self.draft_row_ms(context) * np.asarray(draft_rows, dtype=float)
        return out

    def seq_ms(self, context: float = 0.0) -> float:
        """Cost of one more request in a step at this mean context."""
        return self._at(self.per_seq_ms, context)

    def draft_row_ms(self, context: float = 0.0) -> float:
        """Extra cost of a draft row in a step of several requests at this mean context."""
        return self._at(self.draft_ms, context)

    def _at(self, per_context: tuple[float, ...], context: float) -> float:
        """A per-context cost at this context (interpolated; 0 where none was measured)."""
        return max(0.0, _interp(self.contexts, per_context, context)) if per_context else 0.0

    def critical_decoding_length(self, tolerance: float = 0.1, context: float | None = None) -> int:
        """The largest measured token count whose step costs at most (1 + tolerance) times a
        one-token step: up to here extra tokens are nearly free."""
        ctx = self.contexts[0] if context is None else context
        base = self.time_ms(1, ctx)
        cdl = 1
        for n in self.token_counts:
            if self.time_ms(n, ctx) <= (1 + tolerance) * base:
                cdl = max(cdl, n)
        return cdl

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> CostProfile:
        d = json.loads(text)
        return cls(
            key=str(d["key"]),
            token_counts=tuple(int(x) for x in d["token_counts"]),
            contexts=tuple(int(x) for x in d["contexts"]),
            step_ms=tuple(tuple(float(t) for t in row) for row in d["step_ms"]),
            per_seq_ms=_per_context(d.get("per_seq_ms", ()), len(d["contexts"])),
            row_block=int(d.get("row_block", 1)),
            draft_ms=_per_context(d.get("draft_ms", ()), len(d["contexts"])),
        )

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # A temporary file of its own, then an atomic rename: never a half-written profile, and
        # replicas sharing a cache directory that save at once cannot clobber each other's file.
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(self.to_json())
            os.chmod(tmp, 0o644)  # readable as a plain write leaves it (mkstemp makes it private)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | Path) -> CostProfile:
        try:
            return cls.from_json(Path(path).read_text())
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not a batchserve cost profile ({e})") from None
