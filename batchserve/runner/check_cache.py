"""The start-up invariance check's verdict, cached by file and CPU: a second start of a model read
from a file skips the check it already ran on the same bytes, kernels, CPU, thread count and
engine shape (the 8B's check takes 16 s on two cores; its answer cannot change).

Only a model the engine read from its file itself is cached (`build_checked_runner`'s
`cache_check`: a model handed in may be any object, and is checked every time). The key names
everything the verdict depends on: the file's identity, the forward's profile key (model,
weights, kernels' build for this source, compiler and CPU, thread count), and the row counts and
pool the check used."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from batchserve import native_build
from batchserve.runner.self_check import CheckResult

logger = logging.getLogger("batchserve")
FORMAT = 2  # 2: verdicts carry `finite`


def check_key(runner: Any, config: Any, facts: Any) -> dict[str, Any] | None:
    """What the verdict depends on, or None where it is not cached (not read from a file)."""
    from batchserve.model.gguf_file import file_identity
    from batchserve.runner.profile_key import profile_key

    model = runner.model
    source = Path(str(getattr(model.config, "_name_or_path", "") or ""))
    if getattr(model, "cpu_weights", None) not in ("gguf", "bfloat16") or not source.exists():
        return None
    try:
        identity = file_identity(source) if source.is_file() else {"dir": str(source.resolve())}
    except OSError:
        return None
    sc = config.scheduler
    return {
        "format": FORMAT,
        "file": identity,
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
