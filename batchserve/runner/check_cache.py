"""The start-up invariance check's verdict, cached by file and CPU: a second start of a model read
from a file skips the check it already ran on the same bytes, kernels, CPU, thread count and
engine shape (the 8B's check takes 16 s on two cores; its answer cannot change).

Only a model the engine read from its file itself is cached on disk (`build_checked_runner`'s
`cache_check`). The key names everything the verdict depends on: the file's identity, the
forward's profile key (model, weights, kernels' build for this source, compiler and CPU, thread
count), and the row counts and pool the check used.

A model handed in may be any object: its verdict is kept only in this process, for that object
as it stands (`remembered_check`): every parameter's and buffer's storage and in-place version,
every module's class, and the same engine shape and forward. Benchmarks and tuning build one
engine per method and seat count over one loaded model; each checked what the first had."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import weakref
from itertools import chain
from pathlib import Path
from typing import Any

from batchserve import native_build
from batchserve.runner.self_check import CheckResult

# A handed-in model -> its verdicts this process, by `memo_key` (weak: they go with the model).
_REMEMBERED: weakref.WeakKeyDictionary[Any, dict[str, CheckResult]] = weakref.WeakKeyDictionary()

logger = logging.getLogger("batchserve")
FORMAT = 2  # 2: verdicts carry `finite`


def check_key(runner: Any, config: Any, facts: Any) -> dict[str, Any] | None:
    """What the verdict depends on, or None where it is not cached (not read from a file)."""
    from batchserve.model.gguf_file import file_identity

    model = runner.model
    source = Path(str(getattr(model.config, "_name_or_path", "") or ""))
    if getattr(model, "cpu_weights", None) not in ("gguf", "bfloat16") or not source.exists():
        return None
    try:
        identity = file_identity(source) if source.is_file() else {"dir": str(source.resolve())}
    except OSError:
        return None
    return {"format": FORMAT, "file": identity, **shape_key(runner, config, facts)}


def shape_key(runner: Any, config: Any, facts: Any) -> dict[str, Any]:
    """What the verdict depends on beyond the model's bytes: the forward's profile key, the row
    counts and the pool the check uses, the attention backend."""
    from batchserve.runner.profile_key import profile_key

    sc = config.scheduler
    return {
        "profile": profile_key(runner),
        "rows": [sc.max_num_seqs, sc.max_num_batched_tokens],
        "attention": facts.attention_backend,
        "blocks": facts.num_blocks,
    }


def _path(key: dict[str, Any]) -> Path:
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return native_build.cache_root("checks") / f"{digest}.json"


def cached_check(key: dict[str, Any] | None) -> CheckResult | None:
    if key is None:
        return None
    try:
        entry = json.loads(_path(key).read_text())
        if entry["key"] != key:
            return None
        return CheckResult(*entry["result"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store_check(key: dict[str, Any] | None, result: CheckResult) -> None:
    """Best effort: written whole, then renamed; a read-only cache costs the next start the check."""
    if key is None:
        return
    path = _path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".check-", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "result": list(result)}, f)
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("could not cache the invariance check in %s: %s", path, e)


def memo_key(source: Any, forward: Any, key_of_shape: dict[str, Any]) -> str:
    """What a handed-in model's verdict depends on: the object as it stands (each module's class,
    each parameter's and buffer's storage and version: an in-place change bumps it), the forward
    chosen over it, and the engine's shape (`shape_key`)."""
    tensors = chain(source.parameters(), source.buffers())
    state = [[type(m).__name__ for m in source.modules()], [[id(t), _address(t), t._version] for t in tensors]]
    return json.dumps({"state": state, "forward": repr(forward), **key_of_shape}, sort_keys=True)


def remembered_check(source: Any, key: str) -> CheckResult | None:
    """The verdict this process reached for `source` under `key` (`memo_key`), if any."""
    try:
        return _REMEMBERED.get(source, {}).get(key)
    except TypeError:  # not weakly referable: never remembered
        return None


def remember_check(source: Any, key: str, result: CheckResult) -> None:
    try:
        _REMEMBERED.setdefault(source, {})[key] = result
    except TypeError:
        pass


def _address(t: Any) -> int:
    """Where a tensor's data lives; -1 for one without storage of its own (a wrapper subclass)."""
    try:
        return t.data_ptr()
    except RuntimeError:
        return -1
